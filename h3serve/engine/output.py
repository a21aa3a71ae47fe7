"""What the engine hands back for one request: host arrays plus its measurements."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class GenerationOutput:
    """The decoded arrays (`--decode-mode full`), or, streamed, the files the engine wrote (by download variant:
    video, thumbnail, spritesheet), and the soundtrack either way."""

    video: np.ndarray | None  # [T, H, W, 3] float32 in [0, 1]; None when streamed into files
    audio: np.ndarray | None  # [2, N] float32 in [-1, 1] at 32 kHz; None when streamed by rank processes
    stage_durations: dict[str, float] = field(default_factory=dict)
    # Every run of every stage, (stage, start, end) on the time.monotonic clock (one clock for the host's processes),
    # in start order: the stages that ran beside each other (the MP4 encode and the video decode) overlap.
    stage_timeline: list[tuple[str, float, float]] = field(default_factory=list)
    peak_memory_mb: float = 0.0
    files: dict[str, str] = field(default_factory=dict)  # streamed: variant -> path of the file written
    streamed_frames: int = 0  # streamed: frames in the MP4
    # The engine's running totals (LocalEngine.counters), and from the executor "engine_loads": model loads.
    counters: dict[str, int] = field(default_factory=dict)
    # Several outputs of one prompt: outputs 1..N-1, each its own media (the measurements above are the run's).
    others: list[GenerationOutput] = field(default_factory=list)

    @property
    def outputs(self) -> list[GenerationOutput]:
        """Every output in index order: this one (output 0), then the others."""
        return [self, *self.others]

    @property
    def num_frames(self) -> int:
        return self.streamed_frames if self.video is None else int(self.video.shape[0])
