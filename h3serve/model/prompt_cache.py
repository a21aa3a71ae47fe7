"""The prompt cache: a text encoder's output states kept in host memory for the next request with the same prompt.

Several outputs of a prompt, seed sweeps, real-time sessions and the web page send the same prompt again and again;
with the cache the text encoder runs once for it. The key is everything the states depend on: the encoder (its
identity and the layer read), its dtype, the token ids of the whole presentation (the prompt with any keyframe
labels) and a digest of the vision inputs (the keyframes' pixels, when there are any). A hit copies the stored
states back to the encoder's device: the same bytes the encoder produced, so outputs are byte-identical.

The store is a least-recently-used map bounded in bytes (`--prompt-cache SIZE`, counted by the memory planner as
host memory: h3serve.offload.planner). Every rank of an engine sees the same requests in the same order, so hits
and misses agree across ranks and a tensor-parallel encoder's collectives pair up (or are skipped together).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

import torch

from h3serve.model.adaln_memo import HostCopy, plain_host_copy


@dataclass(frozen=True)
class PromptKey:
    """What a prompt's states depend on."""

    encoder: str  # the encoder's identity and the hidden layer read
    dtype: str
    ids: tuple[int, ...]  # the presentation's token ids
    vision: bytes  # digest of the vision inputs (b"" without any)


def vision_digest(vision: dict[str, torch.Tensor] | None) -> bytes:
    """A digest of every vision input tensor's name, dtype, shape and bytes."""
    if not vision:
        return b""
    h = hashlib.blake2b(digest_size=32)
    for name in sorted(vision):
        t = vision[name].detach().to("cpu").contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
        h.update(t.view(torch.uint8).numpy().data if t.numel() else b"")
    return h.digest()


@dataclass(frozen=True)
class CachedStates:
    states: torch.Tensor  # host memory
    owner: object = None  # what holds the host copy's memory (a pinned arena)

    @property
    def nbytes(self) -> int:
        return self.states.numel() * self.states.element_size()


class PromptCache:
    """States by `PromptKey`, least recently used out first, at most `limit_bytes` in all."""

    def __init__(self, limit_bytes: int, host_copy: HostCopy = plain_host_copy):
        if limit_bytes < 0:
            raise ValueError(f"a prompt cache holds at least 0 bytes, got {limit_bytes}")
        self.limit_bytes = limit_bytes
        self.host_copy = host_copy
        self._store: OrderedDict[PromptKey, CachedStates] = OrderedDict()
        self.hits = 0
        self.misses = 0

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self._store.values())

    def __len__(self) -> int:
        return len(self._store)

    def clear(self) -> None:
        """Forget every entry (a cold cache: what `h3serve bench` measures unless asked otherwise)."""
        self._store.clear()

    def get(self, key: PromptKey, device: torch.device) -> torch.Tensor | None:
        """The stored states on `device` (a copy: the caller may not change the store), or None."""
        entry = self._store.get(key)
        if entry is None:
            self.misses += 1
            return None
        self._store.move_to_end(key)
        self.hits += 1
        return entry.states.to(device, copy=True)

    def put(self, key: PromptKey, states: torch.Tensor) -> None:
        """Keep a host copy of `states`, then evict the oldest entries down to the bound (states larger than the
        whole bound are not kept)."""
        if states.numel() * states.element_size() > self.limit_bytes:
            return
        (host,), owner = self.host_copy([states.detach()])
        if host.data_ptr() == states.data_ptr():  # on a CPU engine the "host copy" is the tensor itself
            host = host.clone()
        self._store[key] = CachedStates(host, owner)
        self._store.move_to_end(key)
        while self.nbytes > self.limit_bytes:
            self._store.popitem(last=False)
