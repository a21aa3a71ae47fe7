"""`ModelDefaults`: what a checkpoint (or a fused adapter) sets for every request it serves. A value type below the
canvas, the validation and the checkpoint readers, which all need it."""

from __future__ import annotations

from dataclasses import dataclass

from h3serve.rules import limits
from h3serve.rules.adapter_choice import AdapterChoice
from h3serve.rules.schedule import PinnedSchedule


@dataclass(frozen=True)
class ModelDefaults:
    """Per-checkpoint defaults (read from the checkpoint, never hard-coded by callers)."""

    canvas_short_edge: int = 768
    canvas_max_pixels: int = 1_032_192
    reference_image_short_edge: int = 2048
    flow_shift: float = 12.0
    audio_flow_shift: float = 3.0
    max_edge: int = limits.MAX_EDGE
    pinned_schedule: PinnedSchedule | None = None  # a checkpoint's or adapter's own schedule (schedule.py)
    fused_adapter: str | None = None  # the FastH3 adapter fused into the T2VA DiT (h3serve.adapters.fasth3)
    controlnet: bool = False  # a ControlNet branch is loaded (--controlnet-model-path): control requests are served
    distilled_checkpoint: str | None = None  # a distilled T2VA-only checkpoint (FastH3 8-step V2): no LoRA on it
    # --cache-backend (cache_dit | tea_cache; None: none): the DiT cache a request that omits `quality` runs under
    server_cache: str | None = None
    merged_lora: AdapterChoice | None = None  # --merge-lora: the LoRA fused into the DiTs, run by every request
