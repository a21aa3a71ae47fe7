"""Exact AdaLN memoisation: every step's modulations computed once, before the denoise loop, and reused.

A DiT block's AdaLN output depends only on the step's distinct timesteps and the weights, and a request's
timesteps are all known before its first step (the schedule; `max(t, 0.999)` for condition rows, 1.0 for audio
references). `AdaLNMemo.prepare` computes the modulations of every step of a request in one pass per block (the
block's AdaLN weights are needed once per request, not once per step, so they may live in host memory:
`WeightScope` brings them in), and keeps them in a bounded host-memory store, from which later requests with the
same schedule take them without computing.

Bit-identical to the forward computing them: the values come from the very functions the forward runs
(`time_embedder`, `AdaLNModulation.table`, `AdaLNOut.modulation`), on the same device, on the same `[T]`
timestep tensor, so every GEMM has the forward's shape and runs its kernel. A GEMM's last bits can depend on how
many rows it holds, so the memo is keyed by a step's whole tuple of distinct timesteps, never by one timestep
value reused across tuples. Of each table only the rows the step's tokens read are kept (a gather copies values).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field

import torch
from torch import nn

from h3serve.model.transformer import NUM_MODALITIES, H3Transformer, StepModulation, compute_dtype

WeightScope = Callable[[nn.Module], AbstractContextManager[None]]  # an AdaLN module's weights, placed for use


def no_scope(_module: nn.Module) -> AbstractContextManager[None]:
    return nullcontext()


@dataclass(frozen=True)
class ForwardTimes:
    """One forward's timesteps: the distinct values and each row's index into them (what the forward takes)."""

    timestep: torch.Tensor  # [T] fp32, sorted
    row_index: torch.Tensor  # [S] long

    def slots(self, token_tags: torch.Tensor) -> torch.Tensor:
        """The AdaLN table rows `t·3 + modality` the step's rows read, sorted."""
        return torch.unique(self.row_index.cpu() * NUM_MODALITIES + token_tags.cpu(), sorted=True)


@dataclass(frozen=True)
class MemoKey:
    """What one step's modulations depend on, besides the digest-checked weights of the engine's DiT."""

    dit: str  # checkpoint component: transformer | transformer_ref
    adapter: str  # identity of the adapter applied to the weights ("" for the base weights; see issue 18)
    dtype: str  # the AdaLN projections' weight / compute dtypes
    timestep: bytes  # the step's distinct timesteps, fp32
    slots: bytes  # the table rows kept, int64


def memo_key(dit: str, model: H3Transformer, step: ForwardTimes, slots: torch.Tensor, adapter: str = "") -> MemoKey:
    linear = model.norm_out.linear
    dtype = f"{linear.weight.dtype}/{compute_dtype(linear)}".replace("torch.", "")
    timestep = step.timestep.to("cpu", torch.float32).contiguous().numpy().tobytes()
    return MemoKey(dit, adapter, dtype, timestep, slots.to(torch.int64).numpy().tobytes())


# Copies tensors (on any device) into host memory: (the host copies in the same order, the object that owns their
# memory, kept with them). The engine gives the store one that copies into a pinned arena of exactly their bytes
# (h3serve.offload.host_arena); the default is plain host tensors.
HostCopy = Callable[[list[torch.Tensor]], tuple[list[torch.Tensor], object]]


def plain_host_copy(tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], object]:
    """Pageable host copies (on CPU the tensors themselves)."""
    return [t.to("cpu") for t in tensors], None


@dataclass(frozen=True)
class MemoEntry:
    """One step's modulations: each block's kept table rows [6, R, D], the row map [T·3] and norm_out's [T, 2D]."""

    tables: tuple[torch.Tensor, ...]
    slots: torch.Tensor
    output: torch.Tensor
    owner: object = field(default=None, compare=False, repr=False)  # what holds a host copy's memory (its arena)

    @property
    def tensors(self) -> list[torch.Tensor]:
        return [*self.tables, self.slots, self.output]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)

    def to(self, device: torch.device) -> MemoEntry:
        """On `device` (asynchronous copies from pinned host memory)."""
        moved = [t if t.device == device else t.to(device, non_blocking=True) for t in self.tensors]
        return MemoEntry(tuple(moved[:-2]), moved[-2], moved[-1])

    def host_copy(self, copy: HostCopy) -> MemoEntry:
        """A host copy of every tensor through `copy` (one arena and one wait for all of them)."""
        host, owner = copy(self.tensors)
        return MemoEntry(tuple(host[:-2]), host[-2], host[-1], owner)

    def step(self, model: H3Transformer) -> StepModulation:
        blocks = model.transformer_blocks
        return StepModulation(
            tables={b.adaln_proj: t for b, t in zip(blocks, self.tables, strict=True)},
            slots=self.slots,
            output=self.output,
        )


def _slot_map(slots: torch.Tensor, num_timesteps: int, device: torch.device) -> torch.Tensor:
    full = torch.full((num_timesteps * NUM_MODALITIES,), -1, dtype=torch.long)
    full[slots] = torch.arange(slots.numel())
    return full.to(device)


def compute_entries(
    model: H3Transformer, steps: list[ForwardTimes], slots: list[torch.Tensor], device: torch.device, scope: WeightScope
) -> list[MemoEntry]:
    """The modulations of `steps`, one pass per block: each block's AdaLN weights are placed once (`scope`)
    and serve every step. Under tensor parallelism every rank calls this with the same steps in the same order
    (the projections all-gather their output)."""
    tembs = [model.time_embedder(s.timestep.to(device)) for s in steps]  # [T, E] fp32, as the forward
    per_block: list[list[torch.Tensor]] = []
    for block in model.transformer_blocks:
        with scope(block.adaln_proj):
            tables = [block.adaln_proj.table(temb) for temb in tembs]  # [6, T·3, D], the forward's GEMM
        per_block.append([t.index_select(1, s.to(device)) for t, s in zip(tables, slots, strict=True)])
    with scope(model.norm_out.linear):
        outputs = [model.norm_out.modulation(temb) for temb in tembs]
    return [
        MemoEntry(
            tables=tuple(block[i] for block in per_block),
            slots=_slot_map(slots[i], steps[i].timestep.numel(), device),
            output=outputs[i],
        )
        for i in range(len(steps))
    ]


class AdaLNMemo:
    """A bounded store (least recently used out first) of per-step modulations in host memory, shared by the
    engine's DiTs; `limit_bytes` 0 keeps nothing between requests (each request still computes its steps once).

    Every rank of a tensor-parallel group sees the same requests in the same order, so its hits and misses are
    the same on every rank and the projections' collectives pair up."""

    def __init__(self, limit_bytes: int, host_copy: HostCopy = plain_host_copy):
        self.limit_bytes = limit_bytes
        self.host_copy = host_copy
        self._store: OrderedDict[MemoKey, MemoEntry] = OrderedDict()
        self.hits = 0  # steps served from the store
        self.misses = 0  # distinct steps computed

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self._store.values())

    def __len__(self) -> int:
        return len(self._store)

    def items(self) -> list[tuple[MemoKey, MemoEntry]]:
        return list(self._store.items())

    def get(self, key: MemoKey) -> MemoEntry | None:
        entry = self._store.get(key)
        if entry is not None:
            self._store.move_to_end(key)
        return entry

    def put(self, key: MemoKey, entry: MemoEntry) -> None:
        """Store a host copy of `entry` (through `host_copy`: on a GPU engine one pinned arena of exactly its bytes,
        sidecar entries read from files included), then evict down to the limit."""
        if entry.nbytes > self.limit_bytes:
            return
        self._store[key] = entry.host_copy(self.host_copy)
        self._store.move_to_end(key)
        while self.nbytes > self.limit_bytes:
            self._store.popitem(last=False)

    def prepare(
        self,
        dit: str,
        model: H3Transformer,
        steps: list[ForwardTimes],
        token_tags: torch.Tensor,
        device: torch.device,
        scope: WeightScope = no_scope,
        adapter: str = "",
    ) -> list[StepModulation]:
        """Every step's modulations on `device`, for the forwards of one request (or continuation window)."""
        slots = [s.slots(token_tags) for s in steps]
        keys = [memo_key(dit, model, s, sl, adapter) for s, sl in zip(steps, slots, strict=True)]
        ready: dict[MemoKey, MemoEntry] = {}
        missing: dict[MemoKey, int] = {}  # key -> the first step that needs it
        for i, key in enumerate(keys):
            if key in ready or key in missing:
                continue
            entry = self.get(key)
            if entry is None:
                missing[key] = i
            else:
                ready[key] = entry.to(device)
                self.hits += 1
        if missing:
            order = list(missing.values())
            computed = compute_entries(model, [steps[i] for i in order], [slots[i] for i in order], device, scope)
            self.misses += len(computed)
            for key, entry in zip(missing, computed, strict=True):
                ready[key] = entry
                self.put(key, entry)
        return [ready[key].step(model) for key in keys]
