"""What the engine hands back for one request: host arrays plus its measurements."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class GenerationOutput:
    video: np.ndarray  # [T, H, W, 3] float32 in [0, 1]
    audio: np.ndarray  # [2, N] float32 in [-1, 1] at 32 kHz
    stage_durations: dict[str, float] = field(default_factory=dict)
    peak_memory_mb: float = 0.0
