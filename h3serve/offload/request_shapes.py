"""The planner as the engine and `h3serve plan` use it: a default request shape, the largest-memory task, a
request's longest pass. What reads the engine's config at start-up is rank-side (h3serve.rank.placement)."""

from __future__ import annotations

from dataclasses import replace

from h3serve.config.offload_config import AUTO, OffloadConfig
from h3serve.offload.activations import RequestShape
from h3serve.offload.inventory import Inventory
from h3serve.offload.placement_plan import MAIN_DIT, TASK_DIT, GiB, PlacementPlan
from h3serve.offload.planner import Runtime, plan_placement
from h3serve.rules import geometry, limits
from h3serve.rules.request import tasks_served
from h3serve.rules.validate import GenerationPlan, ModelDefaults

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
    shape: the smallest of the Ks each shape running the main DiT allows; with an "auto" denoise row chunk, one
    chunk too: the smallest any shape needs (none when every shape fits whole)."""
    plans = [plan_placement(inv, offload, s, device_memory, headroom, memo, runtime) for s in shapes]
    if runtime is not None and runtime.denoise_chunk_rows == AUTO:  # one chunk serves every shape: the smallest
        chunks = [p.denoise_chunk_rows for p in plans if p.denoise_chunk_rows is not None]
        runtime = replace(runtime, denoise_chunk_rows=min(chunks) if chunks else None)
        plans = [plan_placement(inv, offload, s, device_memory, headroom, memo, runtime) for s in shapes]
    if offload.resident_layers == AUTO:
        ks = [p.resident_layers for p, s in zip(plans, shapes, strict=True) if TASK_DIT[s.task] == MAIN_DIT]
        if ks:
            fixed = replace(offload, resident_layers=min(ks))
            plans = [plan_placement(inv, fixed, s, device_memory, headroom, memo, runtime) for s in shapes]
    return max(plans, key=lambda p: p.peak_device_bytes)


def longest_pass(plan: GenerationPlan) -> RequestShape:
    """The shape of a request's longest denoising pass: the whole request, or a continuation's longest window. A
    timeline guide's latent frames count as condition images (each is one canvas-sized latent frame of rows)."""
    frames = max(w.num_frames for w in plan.windows) if plan.windows else plan.num_frames
    source = plan.num_frames if plan.source_video is not None or plan.extend_video is not None else 0
    control = plan.control
    channels = 0 if control is None else sum(
        channels for ref, channels in ((control.control, 3), (control.source, 3), (control.mask, 1)) if ref is not None)
    shape = RequestShape(plan.width, plan.height, frames, plan.task, steps=plan.steps, source_frames=source,
                         control_channels=channels)
    guide_frames = sum(guide.latent_frames for guide in plan.guides)
    return replace(shape, condition_images=shape.images + guide_frames) if guide_frames else shape
