"""The planner as the engine and `h3serve plan` use it: a default request shape, the largest-memory task,
device sizes such as "32GiB"."""

from __future__ import annotations

import re
from dataclasses import replace

from h3serve import geometry, limits
from h3serve.checkpoint import read_layout
from h3serve.config import EngineConfig
from h3serve.offload.activations import RequestShape
from h3serve.offload.config import AUTO, OffloadConfig
from h3serve.offload.inventory import Inventory, build_inventory
from h3serve.offload.plan import GiB, PlacementPlan
from h3serve.offload.planner import MAIN_DIT, TASK_DIT, plan_placement
from h3serve.request import tasks_served
from h3serve.validate import ModelDefaults

DEFAULT_HEADROOM = GiB  # kept free above the estimate: fragmentation the allocator cannot reuse, late kernels
UNITS = {
    "": 1,
    "b": 1,
    "k": 2**10,
    "kib": 2**10,
    "kb": 10**3,
    "m": 2**20,
    "mib": 2**20,
    "mb": 10**6,
    "g": 2**30,
    "gib": 2**30,
    "gb": 10**9,
    "t": 2**40,
    "tib": 2**40,
    "tb": 10**12,
}


def parse_bytes(text: str, flag: str = "--device-memory") -> int:
    """ "32GiB", "24 GB", "80G" (G = GiB), "1000000" (bytes) -> bytes; `ValueError` naming the flag otherwise."""
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in UNITS:
        raise ValueError(f"{flag}: expected a size such as 32GiB, 24GB or 80G, got {text!r}")
    value = int(float(match.group(1)) * UNITS[unit])
    if value <= 0:
        raise ValueError(f"{flag}: must be positive, got {text!r}")
    return value


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
) -> PlacementPlan:
    """The plan of the shape that needs the most device memory. With `resident_layers="auto"` one K serves every
    shape: the smallest of the Ks each shape running the main DiT allows."""
    plans = [plan_placement(inv, offload, s, device_memory, headroom) for s in shapes]
    if offload.resident_layers == AUTO:
        ks = [p.resident_layers for p, s in zip(plans, shapes, strict=True) if TASK_DIT[s.task] == MAIN_DIT]
        if ks:
            fixed = replace(offload, resident_layers=min(ks))
            plans = [plan_placement(inv, fixed, s, device_memory, headroom) for s in shapes]
    return max(plans, key=lambda p: p.peak_device_bytes)


def plan_for_engine(
    config: EngineConfig,
    device_memory: int | None,
    shape: RequestShape | None = None,
    headroom: int = DEFAULT_HEADROOM,
) -> PlacementPlan:
    """The plan the engine logs (and refuses on) at start-up. Without `shape`: the checkpoint's default canvas at
    5 s for every task the loaded DiTs serve, keeping the one that needs the most memory."""
    layout = read_layout(config.model)
    dits = tuple(d for d in config.dits if layout.has(d))
    device = config.resolved_device()
    inv = build_inventory(config.model, config.parallel_degrees(), dits, device.type, config.resolved_dtype())
    shapes = [shape] if shape is not None else [default_shape(layout.defaults(), t) for t in served_tasks(inv)]
    return plan_largest(inv, config.offload, shapes, device_memory, headroom if device_memory else 0)
