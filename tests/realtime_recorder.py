"""A segment writer for the real-time tests that keeps what it is given (the fMP4 bytes are
h3serve.media.fragments' own tests')."""

from __future__ import annotations

import numpy as np


class Recorder:
    def __init__(self, width: int = 0, height: int = 0):
        self.size, self.frames, self.audio, self.finished = (width, height), [], [], False

    def segment(self, frames: np.ndarray, audio: np.ndarray) -> bytes:
        self.frames.append(frames)
        self.audio.append(audio)
        return b"segment %d" % len(self.frames)

    def finish(self) -> bytes:
        self.finished = True
        return b"trailer"

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """Every frame [T, H, W, 3] and sample [S, 2] received."""
        return np.concatenate(self.frames), np.concatenate(self.audio)
