"""A whole soundtrack's AAC packets, encoded on a thread of their own while the video is still being decoded.

The MP4 writer knows the soundtrack when it opens (the audio is decoded before the video), but AAC-encoding it
took about a fifth of a small clip's output stage, in the encoder thread, after the last frame was decoded. Here
the same encoder calls run in the same order on their own thread from the moment the writer opens; the writer
takes each AAC frame's packets when it interleaves them, in exactly the order it muxed them before, so the file's
bytes do not change (tests/media/test_mp4_audio.py).
"""

from __future__ import annotations

import threading
from fractions import Fraction

import av
import numpy as np

AAC_FRAME_SAMPLES = 1024


def aac_input(pcm: np.ndarray, start: int, sample_rate: int, pts: int | None = None) -> av.AudioFrame:
    """The AAC encoder's input frame for `pcm` [2, n]'s samples [start, start + 1024) (fewer at the end): stereo
    fltp on the sample clock, at `pts` (default `start`)."""
    chunk = np.ascontiguousarray(pcm[:, start : start + AAC_FRAME_SAMPLES])
    frame = av.AudioFrame.from_ndarray(chunk, format="fltp", layout="stereo")
    frame.sample_rate, frame.pts, frame.time_base = sample_rate, start if pts is None else pts, Fraction(1, sample_rate)
    return frame


class AacPackets:
    """`pcm` [2, n] float32 encoded frame by frame (1024 samples each, the last one shorter) by `stream`'s encoder
    on a thread started here. `frame(i)` waits for AAC frame i's packets, `flush()` for the encoder's last ones;
    `close()` stops the thread (a writer that failed) and joins it. An encoder error is raised where it is waited
    for."""

    def __init__(self, stream: av.AudioStream, pcm: np.ndarray, sample_rate: int):
        self._stream, self._pcm, self._rate = stream, pcm, sample_rate
        self._frames: list[list[av.Packet]] = []
        self._flushed: list[av.Packet] | None = None
        self._error: BaseException | None = None
        self._stop = False
        self._ready = threading.Condition()
        self._thread = threading.Thread(target=self._encode, name="h3serve-aac", daemon=True)
        self._thread.start()

    def _encode(self) -> None:
        try:
            for start in range(0, self._pcm.shape[1], AAC_FRAME_SAMPLES):
                packets = self._stream.encode(aac_input(self._pcm, start, self._rate))
                with self._ready:
                    if self._stop:
                        return
                    self._frames.append(packets)
                    self._ready.notify_all()
            flushed = self._stream.encode(None)
            with self._ready:
                self._flushed = flushed
                self._ready.notify_all()
        except BaseException as exc:  # handed to the writer, which raises it where it waits
            with self._ready:
                self._error = exc
                self._ready.notify_all()

    def _wait(self, done) -> None:
        with self._ready:
            self._ready.wait_for(lambda: done() or self._error is not None)
            if self._error is not None:
                raise self._error

    def frame(self, index: int) -> list[av.Packet]:
        """AAC frame `index`'s packets (often none: the encoder holds a frame back)."""
        self._wait(lambda: len(self._frames) > index)
        return self._frames[index]

    def flush(self) -> list[av.Packet]:
        """The packets the encoder still held after the last frame."""
        self._wait(lambda: self._flushed is not None)
        assert self._flushed is not None
        return self._flushed

    def close(self) -> None:
        with self._ready:
            self._stop = True
        self._thread.join()
