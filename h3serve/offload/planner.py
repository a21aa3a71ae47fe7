"""The memory planner: (inventory, offload config, request shape) -> `PlacementPlan`. Pure: no device, no file.

Placement per rank and stage (the offload runtime carries out exactly this; `PlacementPlan.component_peak` is
what a placement test observes):
  resident (neither staged nor streamed): on the device in every stage.
  staged: on the device only in its own stages: text_encoder -> text_encode; vae -> vae_encode, video_decode;
      audio_vae -> audio_decode (and vae_encode for ref2va's audio references); a DiT -> denoise, only the DiT
      the task runs (transformer for t2va/fl2va, transformer_ref for ref2va).
  streamed (DiT, text encoder): its base (non-block) bytes in every stage; in its own stage (denoise for the
      task's DiT, text_encode) two slots of its largest streamed block. Under rank-local DLO the first K
      `transformer_blocks` of the main DiT (`transformer`) are resident during denoise only. The other DiT keeps
      its base bytes on the device and never streams.
  host_bytes: staged components whole; streamed components' blocks (all of them: resident blocks are reloaded
      per request), 1/G of each under DLO all-gather (G = ulysses·ring), which is all the load holds of them too:
      each rank reads only its piece from the files (h3serve.loading.dit_pieces), never the whole DiT first.
  AdaLN (h3serve.offload.adaln): with the memo on, the task DiT's modulations during denoise and the memo's
      store in host memory (`adaln_memo`, up to its bound); with the projections in host memory, the DiTs without
      them, and `adaln` in host memory with one slot in denoise.
  overhead (h3serve.offload.overhead): per stage, the runtime terms an nvidia-smi sample adds to the tensors.
  engine (`inv.engine`, h3serve.offload.measured_engine): "vllm-omni" plans as vLLM-Omni runs (its VAE, encoder,
      decode, communicators and retained stage cache), to compare with the figures measured on it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from h3serve.config.offload_config import (
    AUTO,
    DENOISE_CHUNK_LADDER,
    DenoiseChunk,
    OffloadConfig,
    OffloadError,
    check_resident_layers,
)
from h3serve.offload import activations
from h3serve.offload.activations import RequestShape
from h3serve.offload.adaln import adaln_slot, modulation_bytes
from h3serve.offload.inventory import ComponentBytes, Inventory
from h3serve.offload.measured_engine import H3SERVE, communicators, retains_denoise_cache
from h3serve.offload.overhead import runtime_overhead
from h3serve.offload.placement_plan import (
    ADALN,
    ADALN_MEMO,
    CONTROL_MEDIA,
    MAIN_DIT,
    PROMPT_CACHE,
    RESIDENT_GROUP,
    TASK_DIT,
    PlacementPlan,
    RankPlan,
    StagePlan,
    stage_components,
    stages_for,
)


def _streamed_blocks(c: ComponentBytes, resident: int) -> list[int]:
    """Bytes of each block that streams (the first `resident` transformer blocks do not)."""
    out = []
    for g in c.groups:
        out += list(g.block_bytes[resident:] if g.path == RESIDENT_GROUP else g.block_bytes)
    return out


def _resident_for(component: str, config: OffloadConfig, k: int) -> int:
    rank_local = config.distributed and config.transfer == "rank-local"
    return k if component == MAIN_DIT and rank_local else 0


def _placement(c: ComponentBytes, stage: str, task: str, config: OffloadConfig, k: int) -> tuple[int, int]:
    """(resident weight bytes, stream-buffer bytes) of component `c` during `stage`."""
    own = c.name in stage_components(stage, task)
    if c.name in config.streamed_components():
        if not own:
            return c.base_bytes, 0
        resident = _resident_for(c.name, config, k)
        streamed = _streamed_blocks(c, resident)
        kept = sum(sum(g.block_bytes[:resident]) for g in c.groups if g.path == RESIDENT_GROUP)
        return c.base_bytes + kept, 2 * max(streamed, default=0)
    if c.name in config.staged_components():
        return (c.total_bytes if own else 0), 0
    return c.total_bytes, 0


def _host_bytes(c: ComponentBytes, config: OffloadConfig, sp_group: int) -> int:
    if c.name in config.streamed_components():
        blocks = [b for g in c.groups for b in g.block_bytes]
        if config.distributed and config.transfer == "allgather" and c.name in ("transformer", "transformer_ref"):
            return sum(math.ceil(b / sp_group) for b in blocks)
        return sum(blocks)
    if c.name in config.staged_components():
        return c.total_bytes
    return 0


def _check(inv: Inventory, config: OffloadConfig, task: str) -> str:
    if task not in TASK_DIT:
        raise ValueError(f"task must be one of {', '.join(TASK_DIT)}, got {task!r}")
    dit = TASK_DIT[task]
    if dit not in inv.dits:
        raise OffloadError(
            f"task {task} runs {dit}, which is not loaded (loaded: {', '.join(inv.dits)}); plan another task or "
            "load it (--task-type)"
        )
    both = config.staged & config.streamed
    if both:
        raise OffloadError(f"{', '.join(sorted(both))}: a component is either staged or streamed, not both")
    return dit


def _fp8_scratch(held: dict[str, ComponentBytes], stage: str, dit: str) -> int:
    """Weight-only FP8 dequantises one layer at a time: the largest quantised layer of the component the stage
    runs, in the compute dtype, beside the stage's activations."""
    runs = {"denoise": dit, "text_encode": "text_encoder"}.get(stage)
    return held[runs].fp8_scratch if runs in held else 0


@dataclass(frozen=True)
class Runtime:
    """What the plan needs to know of the engine besides placement: AdaLN memo on (its host store's bound), the
    prompt cache's bound,
    whether the DiT is compiled (the compile workspace) and the denoise row chunk (--denoise-chunk-rows)."""

    memo: bool = True
    memo_store: int = 0  # --adaln-memo: the bytes the memo's host store may grow to
    prompt_cache: int = 0  # --prompt-cache: the bytes its host store may grow to (every rank keeps one)
    compiled: bool = False
    # rows per chunk of a block's working set; None: whole; "auto": whole unless only chunks fit (DENOISE_CHUNK_LADDER)
    denoise_chunk_rows: DenoiseChunk = None
    vsa: bool = False  # the DiT blocks run video sparse attention (its tile buffers count in the denoise stage)


def _stage_plan(
    inv: Inventory,
    rank: int,
    held: dict,
    stage: str,
    shape: RequestShape,
    config: OffloadConfig,
    k: int,
    runtime: Runtime,
) -> StagePlan:
    dit = TASK_DIT[shape.task]
    weights, buffers = {}, {}
    for name, c in held.items():
        w, b = _placement(c, stage, shape.task, config, k)
        if w:
            weights[name] = w
        if b:
            buffers[name] = b
    if config.adaln_on_host(runtime.memo) and stage == "denoise":
        buffers[ADALN] = adaln_slot(inv.ranks[rank][dit])
    chunk = runtime.denoise_chunk_rows
    assert chunk != AUTO, "the planner resolves an `auto` row chunk before it plans a stage"
    acts = activations.stage_activations(inv, rank, stage, shape, dit, chunk, runtime.vsa)
    acts += _fp8_scratch(held, stage, dit)
    transient = acts + sum(buffers.values())
    retained = 0
    if retains_denoise_cache(inv.engine, stage, "vae" in config.staged_components()):
        retained = activations.stage_activations(inv, rank, "denoise", shape, dit, chunk, runtime.vsa)
    return StagePlan(
        stage=stage,
        weights=weights,
        stream_buffers=buffers,
        activations=acts,
        modulations=modulation_bytes(inv.dits[dit], shape, inv.element_size)
        if runtime.memo and stage == "denoise"
        else 0,
        overhead=runtime_overhead(
            inv.device_type, len(communicators(inv.engine, inv.degrees, rank)), runtime.compiled, transient, retained
        ),
    )


def _rank_plan(
    inv: Inventory, rank: int, config: OffloadConfig, shape: RequestShape, k: int, runtime: Runtime
) -> RankPlan:
    loaded = inv.ranks[rank]
    adaln_host = config.adaln_on_host(runtime.memo)
    held = {n: c.without_adaln() if adaln_host and n in inv.dits else c for n, c in loaded.items()}
    stages = tuple(
        _stage_plan(inv, rank, held, s, shape, config, k, runtime)
        for s in stages_for(shape.task, shape.source_frames > 0)
    )
    sp = inv.degrees.sequence_parallel
    host = {name: h for name, c in held.items() if (h := _host_bytes(c, config, sp))}
    if adaln_host:
        host[ADALN] = sum(loaded[d].adaln_bytes for d in inv.dits if d in loaded)
    if runtime.memo and runtime.memo_store:
        host[ADALN_MEMO] = runtime.memo_store
    if shape.control_channels:
        host[CONTROL_MEDIA] = shape.control_media_bytes
    if runtime.prompt_cache:
        host[PROMPT_CACHE] = runtime.prompt_cache
    joined = communicators(inv.engine, inv.degrees, rank)
    return RankPlan(rank=rank, stages=stages, host_bytes=host, communicators=joined)


def _build(
    inv: Inventory,
    config: OffloadConfig,
    shape: RequestShape,
    k: int,
    device_memory: int | None,
    headroom: int,
    runtime: Runtime,
) -> PlacementPlan:
    ranks = tuple(_rank_plan(inv, r, config, shape, k, runtime) for r in range(inv.degrees.world_size))
    chunk = runtime.denoise_chunk_rows
    notes = (
        f"request: {shape.describe()}",
        f"weights: {inv.dtype} on {inv.device_type} (fp32 where the dtype policy keeps it)",
        "activations are estimates (h3serve.offload.activations); runtime overhead: stated constants "
        "(h3serve.offload.overhead)",
    )
    if inv.engine != H3SERVE:
        notes += (
            f"as {inv.engine} runs it (h3serve.offload.measured_engine): fp32 video VAE, whole-video decode, its "
            "encoder layout and communicators; to compare with its measurements, not how h3serve runs",
        )
    return PlacementPlan(ranks, resident_layers=k, device_memory=device_memory, headroom=headroom, notes=notes,
                         denoise_chunk_rows=chunk if isinstance(chunk, int) else None)


def main_dit_layers(inv: Inventory) -> int | None:
    cfg = inv.dits.get(MAIN_DIT)
    return None if cfg is None else cfg.num_layers


def plan_placement(
    inv: Inventory,
    config: OffloadConfig,
    shape: RequestShape,
    device_memory: int | None = None,
    headroom: int = 0,
    memo: bool = True,
    runtime: Runtime | None = None,
) -> PlacementPlan:
    """The plan for one request shape (`memo`: AdaLN memoisation on, the engine's default; `runtime`, when given,
    replaces it and adds the memo store's bound, compilation and the denoise row chunk).
    `resident_layers="auto"`: the largest K (never N-1) whose plan fits `device_memory - headroom` on every rank;
    `OffloadError` when none does or the device size is unknown.
    `denoise_chunk_rows="auto"`: whole rows when that fits (or the device size is unknown), else the largest chunk
    of DENOISE_CHUNK_LADDER that fits (with "auto" resident layers, the chunk is tried first: it costs less time
    than streaming blocks), else the smallest chunk's plan, which says by how much it does not fit."""
    _check(inv, config, shape.task)
    rt = runtime or Runtime(memo=memo)
    if rt.denoise_chunk_rows != AUTO:
        return _plan_resident(inv, config, shape, device_memory, headroom, rt)
    rows = math.ceil(shape.seq_len / inv.degrees.sequence_parallel)
    chunks = [None, *(c for c in DENOISE_CHUNK_LADDER if c < rows)]
    failure: OffloadError | None = None
    plan = None
    for chunk in chunks:
        try:
            plan = _plan_resident(inv, config, shape, device_memory, headroom, replace(rt, denoise_chunk_rows=chunk))
        except OffloadError as e:  # "auto" resident layers found no K at this chunk
            failure = e
            continue
        if plan.fits is not False:
            return plan
    if plan is None:
        raise failure
    return plan


def _plan_resident(
    inv: Inventory,
    config: OffloadConfig,
    shape: RequestShape,
    device_memory: int | None,
    headroom: int,
    rt: Runtime,
) -> PlacementPlan:
    """`plan_placement` for a fixed row chunk: resolves "auto" resident layers."""
    layers = main_dit_layers(inv)
    resident = config.resident_layers
    rank_local = config.distributed and config.transfer == "rank-local" and MAIN_DIT in config.streamed_components()
    if resident != "auto":
        if resident and layers is not None and rank_local:
            check_resident_layers(resident, layers)
        return _build(inv, config, shape, resident if rank_local and layers else 0, device_memory, headroom, rt)
    if not rank_local or layers is None:
        return _build(inv, config, shape, 0, device_memory, headroom, rt)
    if device_memory is None:
        raise OffloadError("--dlo-resident-layers auto needs the device size; give --device-memory (e.g. 32GiB)")
    candidates = [k for k in range(layers, -1, -1) if layers - k != 1]
    for k in candidates:
        plan = _build(inv, config, shape, k, device_memory, headroom, rt)
        if plan.fits:
            return plan
    smallest = _build(inv, config, shape, 0, device_memory, headroom, rt)
    raise OffloadError(
        f"--dlo-resident-layers auto: even with 0 resident blocks the plan needs "
        f"{smallest.peak_device_bytes / 2**30:.1f} GiB + {headroom / 2**30:.1f} GiB headroom on a "
        f"{device_memory / 2**30:.1f} GiB device; add ranks (--tensor-parallel-size, --usp) or stage more components"
    )
