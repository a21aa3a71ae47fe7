"""The planner as the engine and `h3serve plan` use it: a default request shape, the largest-memory task,
device sizes such as "32GiB"."""

from __future__ import annotations

from dataclasses import replace

from h3serve import geometry, limits
from h3serve.checkpoint_layout import read_layout
from h3serve.config import EngineConfig
from h3serve.offload.activations import RequestShape
from h3serve.offload.adapters import lora_bytes, with_adapter_bytes, with_lora_blocks
from h3serve.offload.config import AUTO, OffloadConfig
from h3serve.offload.inventory import Inventory, build_inventory
from h3serve.offload.plan import MAIN_DIT, TASK_DIT, GiB, PlacementPlan
from h3serve.offload.planner import Runtime, plan_placement
from h3serve.request import tasks_served
from h3serve.validate import GenerationPlan, ModelDefaults

DEFAULT_HEADROOM = GiB  # kept free above the estimate: fragmentation the allocator cannot reuse, late kernels


def default_shape(defaults: ModelDefaults, task: str) -> RequestShape:
    """The checkpoint's default canvas (16:9) at the default duration (5 s -> 124 frames)."""
    height, width = geometry.resolve_canvas_size(
        *limits.DEFAULT_ASPECT_RATIO, defaults.canvas_short_edge, defaults.canvas_max_pixels
    )
    return RequestShape(width, height, geometry.frames_for_duration(limits.DEFAULT_DURATION_S), task)


def served_tasks(inv: Inventory) -> tuple[str, ...]:
    return tasks_served(inv.dits)


def plan_largest(
    inv: Inventory,
    offload: OffloadConfig,
    shapes: list[RequestShape],
    device_memory: int | None,
    headroom: int,
    memo: bool = True,
    runtime: Runtime | None = None,
) -> PlacementPlan:
    """The plan of the shape that needs the most device memory. With `resident_layers="auto"` one K serves every
    shape: the smallest of the Ks each shape running the main DiT allows."""
    plans = [plan_placement(inv, offload, s, device_memory, headroom, memo, runtime) for s in shapes]
    if offload.resident_layers == AUTO:
        ks = [p.resident_layers for p, s in zip(plans, shapes, strict=True) if TASK_DIT[s.task] == MAIN_DIT]
        if ks:
            fixed = replace(offload, resident_layers=min(ks))
            plans = [plan_placement(inv, fixed, s, device_memory, headroom, memo, runtime) for s in shapes]
    return max(plans, key=lambda p: p.peak_device_bytes)


def plan_for_engine(
    config: EngineConfig,
    device_memory: int | None,
    shape: RequestShape | None = None,
    headroom: int = DEFAULT_HEADROOM,
) -> PlacementPlan:
    """The plan the engine logs (and refuses on) at start-up. Without `shape`: the checkpoint's default canvas at
    5 s for every task the loaded DiTs serve, keeping the one that needs the most memory."""
    layout = read_layout(config.model, config.dits)
    dits = tuple(d for d in config.dits if layout.has(d))
    device = config.resolved_device()
    inv = build_inventory(
        config.model, config.parallel_degrees(), dits, device.type, config.resolved_dtype(), config.quantization
    )
    shapes = [shape] if shape is not None else [default_shape(layout.defaults(), t) for t in served_tasks(inv)]
    shapes = [replace(s, streamed_decode=config.decode_mode == "stream") for s in shapes]
    runtime = engine_runtime(config)
    slot_rank, offloaded = lora_slot_rank(config), offloaded_dits(config)
    inv = with_lora_blocks(inv, slot_rank)  # each block's LoRA factors: placed, staged and streamed with it
    plan = plan_largest(inv, config.offload, shapes, device_memory, headroom if device_memory else 0, runtime=runtime)
    device, host = lora_bytes(inv.dits, slot_rank, inv.degrees.tensor_parallel, inv.element_size,
                              config.max_loras, config.max_cpu_loras, offloaded)
    return with_adapter_bytes(plan, device, host)


def engine_runtime(config: EngineConfig) -> Runtime:
    """The AdaLN memo (and its store's bound) and compilation, as the engine will run them."""
    memo = config.adaln_memo_bytes
    return Runtime(memo=memo is not None, memo_store=memo or 0, compiled=config.compile_mode() is not None)


def lora_slot_rank(config: EngineConfig) -> int:
    """The engine's LoRA slot rank (0 without LoRA)."""
    from h3serve.adapters.serving import catalog_for

    catalog = catalog_for(config, log=lambda text: None)
    return 0 if catalog is None else catalog.slot_rank


def offloaded_dits(config: EngineConfig) -> frozenset[str]:
    """The DiTs whose weights live in host memory (staged or streamed): their LoRA factors live in their blocks."""
    offload = config.offload
    return (offload.staged_components() | offload.streamed_components()) & frozenset(TASK_DIT.values())


def device_memory_of(config: EngineConfig, device) -> int | None:
    """--device-memory, else the GPU's total memory; None on CPU without the flag (no verdict)."""
    if config.device_memory is not None:
        return config.device_memory
    if device.type == "cuda":
        import torch

        return torch.cuda.get_device_properties(device).total_memory
    return None


def placement_for_engine(config: EngineConfig, device, log=None) -> tuple[EngineConfig, PlacementPlan]:
    """At engine start-up, before a weight is read: the plan (logged through `log`), a `ConfigError` when it cannot
    fit the device, and the config with `--dlo-resident-layers auto` resolved to the planner's K."""
    from h3serve.errors import ConfigError
    from h3serve.offload.config import OffloadError
    from h3serve.offload.report import format_plan

    try:
        plan = plan_for_engine(config, device_memory_of(config, device))
    except OffloadError as e:
        raise ConfigError(str(e)) from None
    if log is not None:
        log(format_plan(plan, f"placement plan ({config.offload.describe()})"))
    if plan.fits is False:
        worst = max(plan.ranks, key=lambda r: r.peak_device_bytes)
        raise ConfigError(
            f"this configuration does not fit the device: rank {worst.rank} needs {worst.peak_device_bytes / GiB:.2f} "
            f"GiB in {worst.peak_stage} + {plan.headroom / GiB:.2f} GiB headroom on a {plan.device_memory / GiB:.2f} "
            f"GiB device (short by {plan.shortfall_bytes / GiB:.2f} GiB); offload more (--enable-cpu-offload, "
            "--enable-layerwise-offload, --dlo-resident-layers auto) or shard over more GPUs (-tp, --usp); "
            "`h3serve plan` shows where the memory goes"
        )
    if config.offload.resident_layers == AUTO:
        config = replace(config, offload=replace(config.offload, resident_layers=plan.resident_layers))
    return config, plan


def longest_pass(plan: GenerationPlan) -> RequestShape:
    """The shape of a request's longest denoising pass: the whole request, or a continuation's longest window."""
    frames = max(w.num_frames for w in plan.windows) if plan.windows else plan.num_frames
    return RequestShape(plan.width, plan.height, frames, plan.task, steps=plan.steps)


def long_request_refusal(config: EngineConfig, plan: GenerationPlan, device_memory: int | None) -> str | None:
    """The planner's verdict on a long video request (`long_video_mode` set) before it starts: why its longest pass
    cannot fit the device, or None (it fits, it is not a long request, or the device size is unknown)."""
    if plan.long_video_mode is None or device_memory is None:
        return None
    shape = longest_pass(plan)
    verdict = plan_for_engine(config, device_memory, shape)
    if verdict.fits is not False:
        return None
    return (
        f"its longest pass ({shape.num_frames} frames at {shape.width}x{shape.height}) needs "
        f"{verdict.peak_device_bytes / GiB:.2f} GiB + {verdict.headroom / GiB:.2f} GiB headroom on a "
        f"{device_memory / GiB:.2f} GiB device; use fewer seconds, long_video_mode=continuation, a smaller size or "
        "more offload (`h3serve plan` shows where the memory goes)"
    )
