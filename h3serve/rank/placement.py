"""The placement plan at an engine's start-up and per long request: the planner (h3serve.offload) on this
rank's device, dtype and adapters, read from the engine's config."""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from h3serve.adapters.catalog import LoraCatalog
from h3serve.adapters.header import read_header
from h3serve.adapters.serving import catalog_for, slot_rank
from h3serve.checkpoint.resolver import read_layout
from h3serve.config.engine_config import EngineConfig
from h3serve.config.offload_config import AUTO, OffloadError
from h3serve.errors import ConfigError
from h3serve.offload.activations import RequestShape
from h3serve.offload.inventory import build_inventory
from h3serve.offload.lora_bytes import lora_bytes, with_adapter_bytes, with_lora_blocks
from h3serve.offload.placement_plan import TASK_DIT, GiB, PlacementPlan
from h3serve.offload.plan_report import format_plan
from h3serve.offload.planner import Runtime
from h3serve.offload.realtime_kv import realtime_kv_bytes, with_realtime_cache
from h3serve.offload.request_shapes import DEFAULT_HEADROOM, default_shape, longest_pass, plan_largest, served_tasks
from h3serve.parallel.degrees import ParallelDegrees
from h3serve.rank.device_checks import resolve_device, resolve_dtype
from h3serve.rules import limits
from h3serve.rules.validate import GenerationPlan
from h3serve.rules.validate.realtime_plan import RealtimePlan


def plan_for_engine(
    config: EngineConfig,
    device_memory: int | None,
    shape: RequestShape | None = None,
    headroom: int = DEFAULT_HEADROOM,
    realtime_size: tuple[int, int] = limits.REALTIME_DEFAULT_SIZE,
) -> PlacementPlan:
    """The plan the engine logs (and refuses on) at start-up. Without `shape`: the checkpoint's default canvas at
    5 s for every task the loaded DiTs serve, keeping the one that needs the most memory. With --realtime-lora, a
    session's K/V cache at `realtime_size` (width, height) is held through every stage."""
    layout = read_layout(config.model, config.dits, base=config.base_checkpoint)
    dits = tuple(d for d in config.dits if layout.has(d))
    device = resolve_device(config)
    inv = build_inventory(
        config.model, ParallelDegrees.of(config), dits, device.type, resolve_dtype(config, device), config.quantization,
        base=config.base_checkpoint,
    )
    shapes = [shape] if shape is not None else [default_shape(layout.defaults(), t) for t in served_tasks(inv)]
    shapes = [replace(s, streamed_decode=config.decode_mode == "stream") for s in shapes]
    runtime = engine_runtime(config, device.type)
    catalog = catalog_for(config, log=lambda text: None)  # one read of the adapters' headers per plan
    slot, offloaded = slot_rank(config, catalog), offloaded_dits(config)
    adaln = lora_adaln(config, catalog)
    inv = with_lora_blocks(inv, slot, adaln)  # each block's LoRA factors: placed, staged and streamed with it
    plan = plan_largest(inv, config.offload, shapes, device_memory, headroom if device_memory else 0, runtime=runtime)
    device, host = lora_bytes(
        inv.dits,
        slot,
        inv.degrees.tensor_parallel,
        inv.element_size,
        config.max_loras,
        config.max_cpu_loras,
        offloaded,
        adaln,
    )
    plan = with_adapter_bytes(plan, device + controlnet_bytes(config, inv, shapes), host)
    if config.realtime_lora is None or "transformer" not in inv.dits:
        return plan
    kv = realtime_kv_bytes(inv.dits["transformer"], config.ulysses_degree, inv.element_size, *realtime_size)
    return with_realtime_cache(plan, kv)


def realtime_refusal(config: EngineConfig, plan: RealtimePlan, device_memory: int | None) -> str | None:
    """The planner's verdict on a session's canvas (its K/V cache grows with it), before it starts: why it cannot
    fit the device, or None (it fits, or the device size is unknown)."""
    if device_memory is None:
        return None
    verdict = plan_for_engine(config, device_memory, realtime_size=(plan.width, plan.height))
    if verdict.fits is not False:
        return None
    return (f"a session at {plan.width}x{plan.height} needs {verdict.peak_device_bytes / GiB:.2f} GiB + "
            f"{verdict.headroom / GiB:.2f} GiB headroom on a {device_memory / GiB:.2f} GiB device (its K/V cache "
            "grows with the canvas); use a smaller size or more Ulysses ranks (--usp)")


def controlnet_bytes(config: EngineConfig, inv, shapes: list[RequestShape]) -> int:
    """Device bytes of the ControlNet branch on every rank (it is never cut): its weights in the DiT's dtype (the
    input projection in fp32), and during the denoise its stream and one hint per control block, [S, D] each, at
    the largest shape."""
    path = config.controlnet_model_path
    if path is None or "transformer" not in inv.dits:
        return 0
    header = read_header(path)
    es = inv.element_size
    elements = {key: math.prod(t.shape) for key, t in header.tensors.items()}
    fp32 = sum(n for key, n in elements.items() if key.startswith("control_proj_in."))
    blocks = sum(key.endswith(".after_proj.bias") for key in elements)
    activations = (blocks + 1) * max(s.seq_len for s in shapes) * inv.dits["transformer"].hidden_size * es
    return (sum(elements.values()) - fp32) * es + fp32 * 4 + activations


def engine_runtime(config: EngineConfig, device_type: str) -> Runtime:
    """The AdaLN memo (and its store's bound), the prompt cache's bound and compilation, as the engine will run
    them on `device_type`."""
    memo = config.adaln_memo_bytes
    compiled = config.compile_mode(device_type) is not None
    return Runtime(memo=memo is not None, memo_store=memo or 0, compiled=compiled,
                   denoise_chunk_rows=config.denoise_chunk_rows, vsa=config.sparse_attention,
                   prompt_cache=config.prompt_cache_bytes or 0)


def lora_adaln(config: EngineConfig, catalog: LoraCatalog | None) -> bool:
    """Whether the engine's LoRA wraps the DiTs' AdaLN projections too: when its `catalog` may serve a PDD adapter
    or a FlashGen LoRA (one is preloaded, or --lora-dir may bring one) and those projections stay resident (no DiT
    offload, AdaLN not kept on the host)."""
    adapts_adaln = any(c.pdd or c.flashgen for c in catalog.preloaded.values()) if catalog is not None else False
    if catalog is None or not (catalog.root is not None or adapts_adaln):
        return False
    offload = config.offload
    return not offloaded_dits(config) and not offload.adaln_on_host(config.adaln_memo_bytes is not None)


def offloaded_dits(config: EngineConfig) -> frozenset[str]:
    """The DiTs whose weights live in host memory (staged or streamed): their LoRA factors live in their blocks."""
    offload = config.offload
    return (offload.staged_components() | offload.streamed_components()) & frozenset(TASK_DIT.values())


def device_memory_of(config: EngineConfig, device) -> int | None:
    """--device-memory, else the GPU's total memory; None on CPU without the flag (no verdict)."""
    if config.device_memory is not None:
        return config.device_memory
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return None


def placement_for_engine(config: EngineConfig, device, log=None) -> tuple[EngineConfig, PlacementPlan]:
    """At engine start-up, before a weight is read: the plan (logged through `log`), a `ConfigError` when it cannot
    fit the device, and the config with `--dlo-resident-layers auto` resolved to the planner's K and an `auto`
    denoise row chunk to the planner's (None: whole rows)."""
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
    if config.denoise_chunk_rows == AUTO:
        config = replace(config, denoise_chunk_rows=plan.denoise_chunk_rows)
    return config, plan


def output_batch(config: EngineConfig, plan: GenerationPlan, device_memory: int | None) -> int:
    """How many outputs of a several-output plan denoise as one batch: up to `--max-output-batch`, the most whose
    denoise activations the planner fits on the device (its verdict for the plan's shape with that batch); 1 when
    not even two fit. Without a device size (CPU), `--max-output-batch`."""
    most = min(plan.num_outputs, config.max_output_batch)
    if most < 2 or device_memory is None:
        return most
    shape = longest_pass(plan)
    for batch in range(most, 1, -1):
        if plan_for_engine(config, device_memory, replace(shape, batch=batch)).fits is not False:
            return batch
    return 1


def long_request_refusal(config: EngineConfig, plan: GenerationPlan, device_memory: int | None) -> str | None:
    """The planner's verdict on a long video request (`long_video_mode` set), one that encodes a source video (an
    edit, an extension) or one with timeline guides (their rows lengthen the sequence), before it starts: why its
    longest pass cannot fit the device, or None (it fits, the start-up plan covers it, or the device size is
    unknown)."""
    sourced = plan.source_video is not None or plan.extend_video is not None or bool(plan.guides)
    if (plan.long_video_mode is None and not sourced) or device_memory is None:
        return None
    shape = longest_pass(plan)
    verdict = plan_for_engine(config, device_memory, shape)
    if verdict.fits is not False:
        return None
    return (
        f"its longest pass ({shape.num_frames} frames at {shape.width}x{shape.height}) needs "
        f"{verdict.peak_device_bytes / GiB:.2f} GiB + {verdict.headroom / GiB:.2f} GiB headroom on a "
        f"{device_memory / GiB:.2f} GiB device; use fewer seconds, long_video_mode=continuation, a smaller size"
        f"{', fewer or shorter timeline guides' if plan.guides else ''} or more offload (`h3serve plan` shows where "
        "the memory goes)"
    )
