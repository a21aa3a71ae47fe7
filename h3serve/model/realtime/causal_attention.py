"""The causal attention of a real-time chunk, installed on a DiT's blocks for the length of a session.

Inside a chunk's forwards (`CausalAttention.chunk`) every block attends as TaoMate-H3 was distilled: the text rows
to the text rows only; the media rows (the chunk's audio and video) to [the clean history of earlier chunks | the
chunk's own media rows | the text rows]. In the chunk's σ = 0 pass each block also stages its media keys and values
into the clean K/V cache. Outside a chunk (the audio teacher's forwards) the blocks keep their own attention.

The packed chunk document is [text | audio | video], so the text rows are a prefix and the media rows follow.
Under Ulysses sequence parallelism `wrap` puts the all-to-all around the core: the core sees every row for this
rank's head shard (rows past the document's end are the sequence-parallel padding: their output is zero).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from h3serve.model.realtime.kv_cache import CleanKVCache
from h3serve.model.transformer import AttentionFn, H3Transformer, sdpa_attention

HeadWrap = Callable[[AttentionFn], AttentionFn]


def whole_heads(core: AttentionFn) -> AttentionFn:
    """One rank: the core as it is."""
    return core


@dataclass(frozen=True)
class LiveChunk:
    """The chunk document in flight: its text rows [0, text_rows), media rows [text_rows, seq_len)."""

    text_rows: int
    seq_len: int
    commit: bool  # the σ = 0 pass: stage the media keys and values


class CausalAttention:
    """The causal attention of `dit`'s blocks. `install(cache)` puts it on the blocks for a session, `uninstall`
    gives them their own attention back. The per-block callables are made once: a compiled block (regional
    torch.compile) guards on them, so reinstalling the same ones in the next session reuses its graphs."""

    def __init__(self, dit: H3Transformer, wrap: HeadWrap = whole_heads):
        self.cache: CleanKVCache | None = None
        self.live: LiveChunk | None = None
        self.blocks = list(dit.transformer_blocks)
        self.originals = [block.attn.attention_fn for block in self.blocks]
        self.dispatch = [_Dispatch(self, original, wrap(_Core(self, layer)))
                         for layer, original in enumerate(self.originals)]

    def install(self, cache: CleanKVCache) -> None:
        self.cache = cache
        for block, dispatch in zip(self.blocks, self.dispatch, strict=True):
            block.attn.attention_fn = dispatch

    def uninstall(self) -> None:
        for block, original in zip(self.blocks, self.originals, strict=True):
            block.attn.attention_fn = original
        self.cache, self.live = None, None

    @contextmanager
    def chunk(self, text_rows: int, seq_len: int, commit: bool = False) -> Iterator[None]:
        """The forwards inside run on the chunk document (`commit`: and stage its clean media K/V)."""
        self.live = LiveChunk(text_rows, seq_len, commit)
        try:
            yield
        finally:
            self.live = None


class _Dispatch:
    """A block's attention: causal inside a chunk, its own otherwise."""

    def __init__(self, owner: CausalAttention, original: AttentionFn, causal: AttentionFn):
        self.owner, self.original, self.causal = owner, original, causal

    @torch.compiler.disable  # the cache bookkeeping stays eager inside a compiled block
    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return (self.original if self.owner.live is None else self.causal)(q, k, v)


class _Core:
    """Block `layer`'s causal core over every row of the document (q, k, v [1, R, heads, head_dim], R >= S)."""

    def __init__(self, owner: CausalAttention, layer: int):
        self.owner, self.layer = owner, layer

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        live, cache = self.owner.live, self.owner.cache
        assert live is not None and cache is not None
        text, end = live.text_rows, live.seq_len
        history_k, history_v = cache.history(self.layer)
        keys = torch.cat([history_k, k[:, text:end], k[:, :text]], dim=1)
        values = torch.cat([history_v, v[:, text:end], v[:, :text]], dim=1)
        out = torch.zeros_like(q)
        out[:, :text] = sdpa_attention(q[:, :text], k[:, :text], v[:, :text])
        out[:, text:end] = sdpa_attention(q[:, text:end], keys, values)
        if live.commit:
            cache.stage(self.layer, k[:, text:end], v[:, text:end])
        return out
