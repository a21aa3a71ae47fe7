"""Weight units: the tensors of one module (a component, or one block) that move to the device together.

A unit keeps its master copy in host memory (pinned on CUDA) and, while loaded, a device copy that the module's
parameters point at. Released, every parameter is an empty tensor of its dtype, so a forward through a module
that is not on the device fails loudly instead of computing on stale or absent weights. On a CPU "device" the
master copy is used in place (no copy): placement is still carried out and accounted, which lets tests on a
CPU-only machine check it.

Two kinds: `HostUnit` (each rank keeps its whole shard; rank-local transfer) and `GatheredUnit` (each rank of a
group keeps 1/G of the flattened block; a load rebuilds the block with one all-gather).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from h3serve.offload.host_arena import HostArena
from h3serve.offload.pieces import PieceSources, Value, cut_piece, flat_layout
from h3serve.offload.slots import SlotPair, slot_layout
from h3serve.parallel.comm import gather_into

_CPU_ALIGN, _CUDA_ALIGN = 64, 256  # bytes: the CPU allocator's alignment; CUDA kernels' widest vector loads
Accountant = Callable[[str, str, int], None]  # (component, kind "resident" | "stream", signed bytes)


@dataclass
class _Slot:
    module: nn.Module
    name: str
    is_param: bool
    shape: torch.Size
    dtype: torch.dtype

    def assign(self, value: torch.Tensor) -> None:
        if self.is_param:
            self.module._parameters[self.name] = nn.Parameter(value, requires_grad=False)
        else:
            self.module._buffers[self.name] = value


def _slots(
    module: nn.Module, skip: tuple[nn.Module, ...] = (), keep_meta: bool = False
) -> list[tuple[_Slot, torch.Tensor]]:
    """Every parameter and buffer of `module` outside the `skip` submodules (each tensor once), with its value;
    meta tensors (a weightless skeleton: not this rank's) only with `keep_meta`."""
    skipped = {id(m) for s in skip for m in s.modules()}
    out, seen = [], set()
    for sub in module.modules():
        if id(sub) in skipped:
            continue
        for table, is_param in ((sub._parameters, True), (sub._buffers, False)):
            for name, t in table.items():
                if t is None or (t.is_meta and not keep_meta) or id(t) in seen:
                    continue
                seen.add(id(t))
                out.append((_Slot(sub, name, is_param, t.shape, t.dtype), t.detach()))
    return out


def gathered_values(module: nn.Module, skip: tuple[nn.Module, ...], sources: PieceSources | None) -> list[Value]:
    """A gathered block's tensors in their flat order: each loaded one, or its source where the loader left it on
    the meta device (`ValueError` for a meta tensor without one)."""
    values: list[Value] = []
    for slot, t in _slots(module, skip, keep_meta=True):
        source = sources.get(slot.module, slot.name) if sources is not None and t.is_meta else None
        if t.is_meta and (source is None or source.dtype != t.dtype or tuple(source.shape) != tuple(t.shape)):
            raise ValueError(f"a gathered block's {slot.name} is on the meta device without a source of its shape")
        values.append(t if source is None else source)
    return values


def gathered_layout(values: list[Value], device: torch.device) -> tuple[list[int], dict[torch.dtype, int]]:
    """The flat per-dtype layout of a gathered block's tensors (h3serve.offload.pieces.flat_layout).

    Kernels pick their code path by the address alignment of a weight, and a different path can round differently
    (a 1-row GEMV does on CPU). The output must stay byte-identical to the resident run, so each tensor sits in the
    flat buffer at the alignment its resident twin has: on CPU the loaded tensor's own (the loader gives every
    tensor fresh, aligned storage; a source's rows are never loaded whole: aligned too), on CUDA a fresh
    allocation's (256-byte aligned)."""
    granule = _CUDA_ALIGN if device.type == "cuda" else _CPU_ALIGN

    def misalignment(v: Value) -> int:
        return 0 if device.type == "cuda" or not isinstance(v, torch.Tensor) else v.data_ptr() % granule

    entries = [(v.dtype, math.prod(v.shape), misalignment(v)) for v in values]
    return flat_layout(entries, granule)


class HostUnit:
    """One module's tensors, mastered in host memory and copied to the device on `load`."""

    collective = False  # a rank-local copy: may run on the side copy stream

    def __init__(
        self,
        module: nn.Module,
        component: str,
        kind: str,
        device: torch.device,
        account: Accountant,
        skip: tuple[nn.Module, ...] = (),
        pin: bool | None = None,  # None: pinned on CUDA (one arena of exactly its bytes, h3serve/offload/host_arena)
    ):
        self.component, self.kind, self.device, self._account = component, kind, device, account
        pin = device.type == "cuda" if pin is None else pin
        found = self._find(module, skip)
        hosts = [value if value.is_meta else value.to("cpu") for _, value in found]
        self.arena: HostArena | None = HostArena(hosts, pin=True) if pin else None
        if self.arena is not None:
            hosts = self.arena.views
        self._slots: list[tuple[_Slot, torch.Tensor]] = [(slot, h) for (slot, _), h in zip(found, hosts, strict=True)]
        self.nbytes = sum(t.numel() * t.element_size() for _, t in self._slots)  # on the device when loaded
        self.host_bytes = self.nbytes  # kept in host memory
        self.loaded = False
        self._ready: torch.cuda.Event | None = None
        self.slots: SlotPair | None = None  # streamed: load into one of the component's two slots (runtime sets it)
        self._slot: int | None = None
        self._slot_offsets, self.slot_bytes = slot_layout([h for _, h in self._slots])
        self._release_tensors()

    def _find(self, module: nn.Module, skip: tuple[nn.Module, ...]) -> list[tuple[_Slot, torch.Tensor]]:
        return _slots(module, skip)

    def entries(self) -> list[tuple[nn.Module, str]]:
        """(module, tensor name) of every tensor of the unit, in slot order (`write` takes the index)."""
        return [(slot.module, slot.name) for slot, _ in self._slots]

    def write(self, index: int, value: torch.Tensor) -> None:
        """Overwrite the host master of tensor `index` (shape and dtype kept): the next load carries it; on a CPU
        device, where the master is used in place, a loaded module sees it at once."""
        self._slots[index][1].copy_(value)

    def _release_tensors(self) -> None:
        for slot, host in self._slots:
            slot.assign(torch.empty(0, dtype=host.dtype, device=self.device))

    def load(self, stream: torch.cuda.Stream | None = None) -> None:
        """Copy to the device (asynchronously on `stream` when given; `wait` before use)."""
        if self.loaded:
            return
        if self.slots is not None:
            self._load_into_slot(stream)
        elif self.device.type == "cpu":
            for slot, host in self._slots:
                slot.assign(host)
        else:
            with torch.cuda.stream(stream) if stream is not None else nullcontext():
                for slot, host in self._slots:
                    slot.assign(host.to(self.device, non_blocking=True))
                if stream is not None:
                    self._ready = torch.cuda.Event()
                    self._ready.record(stream)
        self.loaded = True
        self._account(self.component, self.kind, self.nbytes)

    def _load_into_slot(self, stream: torch.cuda.Stream | None) -> None:
        assert self.slots is not None
        self._slot = self.slots.acquire(self, stream)
        hosts = [h for _, h in self._slots]
        async_copy = stream is not None and self.device.type == "cuda"
        with torch.cuda.stream(stream) if async_copy else nullcontext():
            for (slot, host), view in zip(self._slots, self.slots.views(self._slot, hosts, self._slot_offsets),
                                          strict=True):
                view.copy_(host, non_blocking=async_copy)
                slot.assign(view)
            if async_copy:
                self._ready = torch.cuda.Event()
                self._ready.record(stream)

    def wait(self) -> None:
        """Make the compute stream wait for an asynchronous load; keep its memory alive for that stream."""
        if self._ready is None:
            return
        compute = torch.cuda.current_stream(self.device)
        compute.wait_event(self._ready)
        if self.slots is None:  # a slot is never freed: only a fresh allocation needs the stream recorded
            for slot, _ in self._slots:
                table = slot.module._parameters if slot.is_param else slot.module._buffers
                table[slot.name].record_stream(compute)  # allocated on the copy stream, used on the compute stream
        self._ready = None

    def release(self) -> None:
        if not self.loaded:
            return
        self.wait()
        self._release_tensors()
        if self.slots is not None and self._slot is not None:
            self.slots.release(self._slot)
            self._slot = None
        self.loaded = False
        self._account(self.component, self.kind, -self.nbytes)


class GatheredUnit(HostUnit):
    """A block whose flattened tensors (one flat buffer per dtype) are split over `group`: each rank keeps 1/G
    in host memory, and a load rebuilds the whole block on the device with one all-gather per dtype.

    Every rank of the group holds the same block (the same tensor-parallel shard), so the pieces fit together;
    all ranks load the same units in the same order (the block order is fixed), so the collectives pair up.
    `overlap`: the blocks' collectives all run on `group`'s communicator (`RankParallel.one_denoise_communicator`),
    so a prefetch (`load_ahead`) may leave its gather in flight while the block before it computes.
    `sources`: where the block's meta tensors are read from (a block the loader left on the meta device,
    h3serve.offload.pieces): only the rows this rank's piece covers are read, and the whole block never exists here.
    """

    def __init__(
        self,
        module: nn.Module,
        component: str,
        kind: str,
        device: torch.device,
        account: Accountant,
        group: ProcessGroup,
        skip: tuple[nn.Module, ...] = (),
        overlap: bool = False,
        sources: PieceSources | None = None,
    ):
        self.group, self.size, self.rank = group, dist.get_world_size(group), dist.get_rank(group)
        self.overlap = overlap
        self._works: list = []  # a prefetch's gathers in flight (`wait` completes them)
        values = gathered_values(module, skip, sources)  # before the base class releases the module's tensors
        super().__init__(module, component, kind, device, account, skip, pin=False)  # only this rank's piece is pinned
        self._offsets, totals = gathered_layout(values, device)
        self._flats: dict[torch.dtype, torch.Tensor] = {  # dtype -> this rank's host piece
            dtype: cut_piece(values, self._offsets, dtype, n, self.rank, self.size) for dtype, n in totals.items()
        }
        if device.type == "cuda":  # this rank's pieces in one pinned arena of exactly their bytes
            self.arena = HostArena(list(self._flats.values()), pin=True)
            self._flats = dict(zip(self._flats, self.arena.views, strict=True))
        # Only this rank's piece stays in host memory.
        self._slots = [(slot, torch.empty(0, dtype=h.dtype)) for slot, h in self._slots]
        self.host_bytes = sum(p.numel() * p.element_size() for p in self._flats.values())

    def _find(self, module: nn.Module, skip: tuple[nn.Module, ...]) -> list[tuple[_Slot, torch.Tensor]]:
        return _slots(module, skip, keep_meta=True)

    collective = True  # its load is a collective: issued on the compute stream, never on a side stream

    def write(self, index: int, value: torch.Tensor) -> None:
        """Overwrite tensor `index`: this rank keeps only the part of it that falls in its piece of the flat
        buffer (every rank of the group writes the same value, so the gathered block holds all of it)."""
        slot = self._slots[index][0]
        flat = self._flats[slot.dtype]
        lo, start = self.rank * flat.numel(), self._offsets[index]
        first, last = max(start, lo), min(start + slot.shape.numel(), lo + flat.numel())
        if first < last:
            flat[first - lo : last - lo] = value.reshape(-1)[first - start : last - start].to(slot.dtype)

    def load(self, stream: torch.cuda.Stream | None = None) -> None:
        """Rebuild the block with one all-gather per dtype, into one tensor (a list of chunks would make NCCL
        gather into a temporary flat buffer and copy out of it: twice the block, unplanned), completed before the
        compute stream goes on.

        `stream` is ignored: the gather is issued from the compute stream, in program order with the Ulysses
        all-to-all and TP all-reduce of the blocks around it. Issued from a side stream it would run concurrently
        with them on another communicator, which NCCL documents can deadlock (`load_ahead` overlaps only where
        one communicator carries them all)."""
        self._gather(in_flight=False)

    def load_ahead(self) -> None:
        """A prefetch: with `overlap`, the gathers are issued and left in flight (on NCCL its stream runs them
        while the compute stream runs the current block, whose own exchanges queue behind them on the same
        communicator); `wait` completes them before the block runs. Without `overlap`, `load`."""
        self._gather(in_flight=self.overlap)

    def wait(self) -> None:
        for work, _ in self._works:
            work.wait()
        self._works = []

    def _gather(self, in_flight: bool) -> None:
        if self.loaded:
            return
        full: dict[torch.dtype, torch.Tensor] = {}
        for dtype, mine in self._flats.items():
            buffer = torch.empty(mine.numel() * self.size, dtype=dtype, device=self.device)
            wire = torch.uint8 if dtype.itemsize == 1 else dtype  # FP8 weights travel as their bytes
            piece = mine.to(self.device, non_blocking=True).view(wire)
            work = gather_into(buffer.view(wire), piece, self.group, async_op=in_flight)
            if in_flight:  # the device copy of the piece stays referenced until its gather is waited for
                self._works.append((work, piece))
            full[dtype] = buffer
        for (slot, _), start in zip(self._slots, self._offsets, strict=True):
            slot.assign(full[slot.dtype][start : start + slot.shape.numel()].view(slot.shape))
        self.loaded = True
        self._account(self.component, self.kind, self.nbytes)
