"""The sigma ladders of a real-time chunk and its Euler step, in vLLM-Omni's TaoMate-H3 arithmetic.

The student (the DiT with the streaming LoRA) takes three steps per chunk at ladder points (0, 16, 33, 49) of the
50-point shifted ladders (shift 12 for video, 3 for audio); the audio teacher (the base model) walks the whole
10-point ladders (nine forwards). A ladder is `s·b / (1 + (s - 1)·b)` over `b = linspace(1, 0, n)` in float32.
"""

from __future__ import annotations

import torch

from h3serve.model.scheduler import shift_sigma
from h3serve.rules.realtime_geometry import LADDER_INDICES, LADDER_POINTS, TEACHER_POINTS

VIDEO_SHIFT, AUDIO_SHIFT = 12.0, 3.0


def ladder(points: int, shift: float, indices: tuple[int, ...] | None = None) -> list[float]:
    """The `points`-point shifted sigma ladder (float32, as Python floats), or its points at `indices`."""
    sigmas = shift_sigma(torch.linspace(1.0, 0.0, points, dtype=torch.float32), shift)
    values = [float(s) for s in sigmas.tolist()]
    return values if indices is None else [values[i] for i in indices]


def student_sigmas() -> tuple[list[float], list[float]]:
    """(video, audio) sigmas of the three student steps (four points, the last 0)."""
    return ladder(LADDER_POINTS, VIDEO_SHIFT, LADDER_INDICES), ladder(LADDER_POINTS, AUDIO_SHIFT, LADDER_INDICES)


def teacher_sigmas() -> tuple[list[float], list[float]]:
    """(video, audio) sigmas of the audio teacher's nine forwards (ten points, the last 0)."""
    return ladder(TEACHER_POINTS, VIDEO_SHIFT), ladder(TEACHER_POINTS, AUDIO_SHIFT)


def euler_(state: torch.Tensor, velocity: torch.Tensor, sigma: float, sigma_next: float) -> torch.Tensor:
    """One Euler (eta 0) step in place, in the release's order: x0 = x + σ·v; x ← r·x + (1 - r)·x0, r = σ'/σ."""
    denoised = torch.add(state, velocity, alpha=sigma)
    ratio = sigma_next / sigma
    return state.mul_(ratio).add_(denoised, alpha=1.0 - ratio)
