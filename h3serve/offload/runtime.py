"""Carrying out an OffloadConfig on loaded components: staged components, streamed blocks, resident prefixes.

The pipeline announces each request (`request(task)`) and stage (`stage(name)`); `OffloadRuntime` loads what
the stage computes with and releases what it does not (`plan.stage_components`), while forward hooks stream
the blocks of streamed components through two device slots: block i+1 is copied (on a side stream on CUDA)
while block i runs, and block i is released when it returns.

`PlacementLog` records, per stage and component, the most weight bytes that were ever on the device, split
into "resident" (whole components, non-block parameters, resident blocks) and "stream" (blocks passing
through): the accounting hook a test compares against the `PlacementPlan`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed import ProcessGroup

from h3serve.config.offload_config import OffloadConfig
from h3serve.model.pipeline_types import H3Components
from h3serve.offload.host_heap import release_free_heap
from h3serve.offload.lora_bytes import ADAPTERS
from h3serve.offload.pieces import PieceSources
from h3serve.offload.placement_plan import (
    ADALN,
    BLOCK_GROUPS,
    MAIN_DIT,
    RESIDENT_GROUP,
    STAGES,
    RankPlan,
    stage_components,
)
from h3serve.offload.slots import SlotPair
from h3serve.offload.units import GatheredUnit, HostUnit


@dataclass
class PlacementLog:
    """Weight bytes on the device per (component, kind), now and at their most in each stage."""

    current: dict[tuple[str, str], int] = field(default_factory=dict)
    peaks: dict[str, dict[tuple[str, str], int]] = field(default_factory=dict)
    stage: str | None = None
    streamed: dict[tuple[str, str], int] = field(default_factory=dict)  # (stage, component) -> bytes copied in

    def account(self, component: str, kind: str, delta: int) -> None:
        key = (component, kind)
        self.current[key] = self.current.get(key, 0) + delta
        if kind == "stream" and delta > 0 and self.stage is not None:
            moved = (self.stage, component)
            self.streamed[moved] = self.streamed.get(moved, 0) + delta
        if self.stage is not None:
            peaks = self.peaks.setdefault(self.stage, {})
            peaks[key] = max(peaks.get(key, 0), self.current[key])

    def enter(self, stage: str | None) -> None:
        self.stage = stage
        if stage is not None:
            peaks = self.peaks.setdefault(stage, {})
            for key, value in self.current.items():
                peaks[key] = max(peaks.get(key, 0), value)

    def peak(self, stage: str, component: str, kind: str) -> int:
        return self.peaks.get(stage, {}).get((component, kind), 0)

    def reset(self) -> None:
        self.peaks.clear()
        self.streamed.clear()


def _component_modules(components: H3Components) -> dict[str, nn.Module]:
    modules = {
        "transformer": components.transformer,
        "transformer_ref": components.transformer_ref,
        "text_encoder": components.text.model,
        "vae": components.vae,
        "audio_vae": components.audio_vae,
    }
    return {name: m for name, m in modules.items() if m is not None}


def streamed_blocks(component: str, module: nn.Module) -> dict[str, list[nn.Module]]:
    """The block groups of a streamed component (`plan.BLOCK_GROUPS`), in execution order."""
    if component not in BLOCK_GROUPS:
        raise ValueError(f"{component} has no repeated blocks to stream")
    return {path: list(module.get_submodule(path)) for path in BLOCK_GROUPS[component]}


def adaln_modules(dit: nn.Module) -> list[nn.Module]:
    """A DiT's AdaLN projections: each transformer block's `adaln_proj`, then `norm_out.linear`."""
    return [*(b.adaln_proj for b in dit.get_submodule(RESIDENT_GROUP)), dit.norm_out.linear]


def tensor_bytes(module: nn.Module, skip: tuple[nn.Module, ...] = ()) -> int:
    """Bytes of the module's parameters and buffers on a real device (meta skeleton tensors and the `skip`
    modules' excluded)."""
    seen = {id(t) for m in skip for t in [*m.parameters(), *m.buffers()]}
    total = 0
    for t in [*module.parameters(), *module.buffers()]:
        if not t.is_meta and id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


class _BlockStream:
    """Streams blocks through two device slots. `cycle_to`: after the last block, prefetch that block (the first
    streamed block of the next denoise step); `release_all` drops a prefetch left over at the end of a stage."""

    def __init__(self, blocks: list[nn.Module], units: list[HostUnit], copy_stream, cycle_to: int | None):
        self.units, self.copy_stream, self.cycle_to = units, copy_stream, cycle_to
        self.handles = []
        for i, block in enumerate(blocks):
            self.handles.append(block.register_forward_pre_hook(lambda _m, _a, i=i: self._before(i)))
            self.handles.append(block.register_forward_hook(lambda _m, _a, _o, i=i: self._after(i)))

    def _before(self, i: int) -> None:
        unit = self.units[i]
        unit.load()  # no-op when the previous block prefetched it
        unit.wait()
        nxt = i + 1 if i + 1 < len(self.units) else self.cycle_to
        if nxt is not None and nxt != i:
            prefetch = self.units[nxt]
            if prefetch.collective:  # issued from the compute stream, in flight where it may (GatheredUnit)
                prefetch.load_ahead()
            else:
                prefetch.load(self.copy_stream)

    def _after(self, i: int) -> None:
        self.units[i].release()

    def release_all(self) -> None:
        for unit in self.units:
            unit.release()


class OffloadRuntime:
    """Installs the placement of one rank's components and carries it out stage by stage."""

    def __init__(
        self,
        components: H3Components,
        config: OffloadConfig,
        device: torch.device,
        gather_group: ProcessGroup | None = None,  # the sequence-parallel group, for DLO all-gather
        adaln_host: bool = False,  # AdaLN projections in host memory (`OffloadConfig.adaln_on_host`)
        keep: tuple[nn.Module, ...] = (),  # modules no unit takes: they stay where they are (the LoRA scales)
        overlap_gather: bool = False,  # the blocks' collectives share the gather's communicator (GatheredUnit)
        sources: PieceSources | None = None,  # gathered blocks left on the meta device: their tensors' sources
    ):
        self.config, self.device, self.overlap_gather = config, device, overlap_gather
        self.task: str | None = None  # set by `request`
        self.log = PlacementLog()
        self.copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        modules = _component_modules(components)
        staged, streamed = config.staged_components(), config.streamed_components()
        self.staged: dict[str, HostUnit] = {}
        self.streams: dict[str, list[_BlockStream]] = {}
        self.prefix: list[HostUnit] = []  # resident DiT blocks: on the device for the denoise stage only
        self.host_bytes: dict[str, int] = {}
        self.slots: dict[str, SlotPair] = {}  # per streamed component on CUDA: its two device slots
        self.adaln_units: dict[nn.Module, HostUnit] = {}  # AdaLN projections kept in host memory
        self.rests: list[HostUnit] = []  # streamed components' non-block tensors (loaded for good)
        if adaln_host:  # first: the other units of a DiT skip these modules
            for name in ("transformer", "transformer_ref"):
                for m in adaln_modules(modules[name]) if name in modules else ():
                    self.adaln_units[m] = HostUnit(m, ADALN, "stream", device, self.log.account)
            self.host_bytes[ADALN] = sum(u.host_bytes for u in self.adaln_units.values())
        self.skip = tuple(self.adaln_units) + keep
        for name, module in modules.items():
            if name in staged:
                self.staged[name] = HostUnit(module, name, "resident", device, self.log.account, skip=self.skip)
                self.host_bytes[name] = self.staged[name].host_bytes
            elif name in streamed:
                self._stream(name, module, gather_group, sources)
            else:  # loaded onto the device already
                self.log.account(name, "resident", tensor_bytes(module, keep))
        self.host_bytes = {name: n for name, n in self.host_bytes.items() if n}  # a weightless skeleton keeps none
        self.owners: dict[tuple[int, str], tuple[HostUnit, int]] = {}  # (id(module), tensor name) -> its unit
        for unit in self.units():
            for index, (module, tensor) in enumerate(unit.entries()):
                self.owners[(id(module), tensor)] = (unit, index)

    def units(self) -> list[HostUnit]:
        """Every weight unit this runtime moves."""
        streamed = [u for streams in self.streams.values() for stream in streams for u in stream.units]
        return [*self.adaln_units.values(), *self.staged.values(), *self.prefix, *streamed, *self.rests]

    def owns(self, module: nn.Module, name: str) -> bool:
        """Whether a unit holds `module`'s tensor `name` (its master copy lives in host memory)."""
        return (id(module), name) in self.owners

    def write(self, items: list[tuple[nn.Module, str, torch.Tensor]]) -> None:
        """Overwrite the host masters of unit-held tensors (e.g. an offloaded DiT's LoRA factors) between
        requests; the loads that follow carry the new values. Waits for the device first: no copy still reads a
        master being rewritten."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        for module, name, value in items:
            unit, index = self.owners[(id(module), name)]
            unit.write(index, value)

    def _stream(
        self, name: str, module: nn.Module, gather_group: ProcessGroup | None, sources: PieceSources | None
    ) -> None:
        groups = streamed_blocks(name, module)
        resident = self.config.resident_layers if name == MAIN_DIT else 0
        assert isinstance(resident, int), "resident_layers 'auto' is resolved by the planner before the runtime"
        every_block = tuple(b for blocks in groups.values() for b in blocks)
        rest = HostUnit(module, name, "resident", self.device, self.log.account, skip=every_block + self.skip)
        rest.load()  # non-block parameters (embedders, norms, heads) stay on the device
        self.rests.append(rest)
        gathered = self.config.gathers(name, gather_group is not None)
        units_of_component: list[HostUnit] = []
        streamed_units: list[HostUnit] = []
        self.streams[name] = []
        for group, blocks in groups.items():
            keep = resident if group == RESIDENT_GROUP else 0
            log, skip = self.log.account, self.skip
            prefix = [HostUnit(b, name, "resident", self.device, log, skip) for b in blocks[:keep]]
            self.prefix += prefix
            moving = blocks[keep:]
            if gathered:
                args = (name, "stream", self.device, log, gather_group, skip, self.overlap_gather, sources)
                units = [GatheredUnit(b, *args) for b in moving]
            else:
                units = [HostUnit(b, name, "stream", self.device, log, skip) for b in moving]
            units_of_component += prefix + units
            streamed_units += units
            if units:  # DiT blocks run once per step: the last prefetches the first streamed one of the next step
                cycle_to = 0 if group == RESIDENT_GROUP else None
                self.streams[name].append(_BlockStream(moving, units, self.copy_stream, cycle_to))
        self.host_bytes[name] = sum(u.host_bytes for u in units_of_component)
        if self.device.type == "cuda" and not gathered and streamed_units:  # CPU: blocks are used in place
            self.slots[name] = share_slots(streamed_units, self.device)

    # -- the pipeline's stage hooks --------------------------------------------------------------------------

    @contextmanager
    def request(self, task: str) -> Iterator[None]:
        """One request: stages inside it place components for `task`; afterwards nothing staged stays loaded."""
        self.task = task
        self.log.reset()
        try:
            yield
        finally:
            self.log.enter(None)
            for unit in self.staged.values():
                unit.release()
            for unit in self.prefix:
                unit.release()
            for streams in self.streams.values():
                for stream in streams:
                    stream.release_all()

    @contextmanager
    def weights(self, module: nn.Module) -> Iterator[None]:
        """An AdaLN projection kept in host memory, on the device while its modulations are computed."""
        unit = self.adaln_units.get(module)
        if unit is None:  # on the device already
            yield
            return
        unit.load()
        try:
            yield
        finally:
            unit.release()

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        if name not in STAGES:  # e.g. vision preprocessing: no model runs
            yield
            return
        needed = stage_components(name, self.task)
        for component, unit in self.staged.items():  # release first: never two staged components at once
            if component not in needed:
                unit.release()
        self.log.enter(name)
        for component, unit in self.staged.items():
            if component in needed:
                unit.load()
        if MAIN_DIT in needed:
            for unit in self.prefix:
                unit.load()
        try:
            yield
        finally:
            for streams in self.streams.values():  # a prefetch for a next step that will not come
                for stream in streams:
                    stream.release_all()
            for pair in self.slots.values():
                pair.drop()
            if name == "denoise":  # resident blocks, and the host heap's freed activations, make room for the decode
                for unit in self.prefix:
                    unit.release()
                release_free_heap()
            self.log.enter(None)


def share_slots(units: list[HostUnit], device: torch.device) -> SlotPair:
    """One pair of device slots for all of a component's streamed units (its block groups run one after another)."""
    pair = SlotPair([u.slot_bytes for u in units], device)
    for unit in units:
        unit.slots = pair
    return pair


def placement_mismatches(log: PlacementLog, plan: RankPlan, stages: tuple[str, ...]) -> list[str]:
    """Where the placement the hooks carried out differs from the plan (empty when it matches).

    Per stage and component: the resident bytes must equal the plan's `weights` exactly; the bytes that streamed
    through may not exceed its `stream_buffers` (two slots of the largest block: a stage may never fill both, e.g.
    a text-only prompt never runs the vision tower). The LoRA device cache is allocated by the LoRA runtime, not
    placed here: it is not compared. A text encode the request skipped (a prompt-cache hit: the encoder is neither
    run nor placed) has nothing to compare."""
    problems = []
    for stage in stages:
        if stage == "text_encode" and stage not in log.peaks:
            continue
        planned = plan.stage(stage)
        seen = {c for c, _ in log.peaks.get(stage, {})} | set(planned.weights) | set(planned.stream_buffers)
        seen.discard(ADAPTERS)
        for component in sorted(seen):
            resident = log.peak(stage, component, "resident")
            if resident != planned.weights.get(component, 0):
                problems.append(
                    f"{stage}/{component}: {resident} B resident, planned {planned.weights.get(component, 0)}"
                )
            streamed, slots = log.peak(stage, component, "stream"), planned.stream_buffers.get(component, 0)
            # A request whose modulations all come from the memo loads no AdaLN projection.
            if streamed > slots or (slots and not streamed and stage == "denoise" and component != ADALN):
                problems.append(f"{stage}/{component}: {streamed} B streamed, planned slots {slots}")
    return problems
