"""The one request type every entry point (CLI, HTTP, web page) builds and the engine consumes."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GenerationRequest:
    """What a user asked for, before validation. `None` means "use the model's default"."""

    prompt: str
    width: int | None = None
    height: int | None = None
    aspect_ratio: str | None = None  # "W:H", e.g. "16:9"; only when width/height are not given
    duration_s: float | None = None
    num_frames: int | None = None  # alternative to duration_s; snapped up to 17n + 5
    steps: int | None = None  # num_inference_steps with the reference's meaning: N grid points
    seed: int | None = None
    flow_shift: float | None = None  # video sigma shift (checkpoint default 12)
    audio_flow_shift: float | None = None  # audio sigma shift (checkpoint default 3)
