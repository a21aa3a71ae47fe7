"""A stand-in for the engine's real-time sessions (h3serve.engine.realtime_stream) that needs no model: the API tests
run the WebSocket protocol, its limits and the web page against real fragmented-MP4 segments in milliseconds.

`FakeRealtimeStream` keeps `RealtimeStream`'s contract: the session's real chunk geometry
(h3serve.rules.realtime_geometry: the frames and samples each chunk publishes), a new prompt from the next chunk
boundary on with vLLM-Omni's event ids (started = active = the applied event; completed = it and the ones it overwrote),
`stop` after the chunk in flight then the trailer then None, `close` at once and idempotent. Each chunk's frames are
synthetic, their colour set by the prompt in force (`prompt_colour`), encoded by the real `FragmentWriter`.
"""

from __future__ import annotations

import hashlib
import threading
import time

import numpy as np
from fake_executor import FakeExecutor

from h3serve.engine.realtime_stream import (
    Interaction,
    RealtimeBusy,
    RealtimeChunk,
    RealtimeSpec,
    RealtimeUnavailable,
)
from h3serve.errors import RequestError
from h3serve.media.fragments import FragmentWriter
from h3serve.media.mp4 import EncoderOptions
from h3serve.rules import limits
from h3serve.rules.realtime_geometry import published_frames, samples_at
from h3serve.rules.validate.realtime_plan import plan_realtime

FAIL_AT_PROMPT = "please fail at chunk 2"  # the engine fails while making chunk 2
STALL_PROMPT = "please stall after chunk 1"  # no chunk comes after chunk 1


def prompt_colour(prompt: str) -> np.ndarray:
    """The RGB a prompt paints its chunks in (far apart for different prompts)."""
    digest = hashlib.sha256(prompt.encode()).digest()
    return np.array([40 + digest[i] % 176 for i in range(3)], dtype=np.uint8)


class FakeRealtimeStream:
    def __init__(self, spec: RealtimeSpec, chunks: int, chunk_s: float, release):
        self.spec, self.chunks, self.chunk_s, self._release = spec, chunks, chunk_s, release
        self.writer = FragmentWriter(spec.width, spec.height, options=EncoderOptions(preset="ultrafast", threads=1))
        self.prompt = spec.prompt
        self.prompts: list[str] = []  # the prompt each chunk was made with
        self.interactions: list[Interaction] = []
        self.closed = self.stopped = False
        self._pending: list[Interaction] = []
        self._index = 0
        self._ready_at: float | None = None  # when the chunk being made is ready
        self._state = "running"  # running -> ended (trailer next) -> done
        self._lock = threading.Lock()

    def interact(self, interaction: Interaction) -> None:
        with self._lock:
            if self._state != "running":
                raise RequestError("session", "the session has ended; it takes no more interactions")
            self.interactions.append(interaction)
            self._pending.append(interaction)

    def stop(self) -> None:
        with self._lock:
            self.stopped = True

    def next_chunk(self, timeout_s: float) -> RealtimeChunk | None:
        if self._state == "done":
            return None
        if self._state == "ended":
            self._finish()
            return RealtimeChunk(self._index, "trailer", 0, 0, limits.AUDIO_SAMPLE_RATE, self.writer.finish(), (), (),
                                 ())
        if self.prompt == STALL_PROMPT and self._index >= 2:
            time.sleep(timeout_s)
            raise TimeoutError(f"no chunk within {timeout_s:g} s")
        if self._ready_at is None:  # the chunk is being made from now on
            self._ready_at = time.monotonic() + self.chunk_s
        wait = self._ready_at - time.monotonic()
        if wait > timeout_s:
            time.sleep(timeout_s)
            raise TimeoutError(f"no chunk within {timeout_s:g} s")
        time.sleep(max(wait, 0))
        self._ready_at = None
        return self._media()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._finish()

    def _media(self) -> RealtimeChunk:
        with self._lock:  # the boundary: the last interaction queued before it wins
            started = (self._pending[-1].event_id,) if self._pending else ()
            completed = tuple(i.event_id for i in self._pending)
            if self._pending:
                self.prompt = self._pending[-1].prompt
            self._pending = []
        if self.prompt == FAIL_AT_PROMPT and self._index == 2:
            raise RuntimeError("the fake engine failed")
        first, count = published_frames(self._index, self.chunks)
        samples = samples_at(first + count) - samples_at(first)
        frames = np.broadcast_to(prompt_colour(self.prompt), (count, self.spec.height, self.spec.width, 3)).copy()
        frames[:, :, : self.spec.width // 4] = (first + np.arange(count))[:, None, None, None] % 256  # it moves
        t = (samples_at(first) + np.arange(samples)) / limits.AUDIO_SAMPLE_RATE
        audio = np.repeat((0.2 * np.sin(2 * np.pi * 330 * t))[:, None], 2, axis=1).astype(np.float32)
        chunk = RealtimeChunk(self._index, "media", count, samples, limits.AUDIO_SAMPLE_RATE,
                              self.writer.segment(frames, audio), started, started, completed)
        self.prompts.append(self.prompt)
        self._index += 1
        with self._lock:
            if self.stopped or self._index == self.chunks:
                self._state = "ended"
        return chunk

    def _finish(self) -> None:
        if self._state != "done":
            self._state = "done"
            self._release()


class FakeRealtimeExecutor(FakeExecutor):
    """`FakeExecutor` that also opens fake real-time sessions, one at a time (jobs and sessions share its lock),
    checked by the real session rules; `realtime=False` is a server without --realtime-lora."""

    def __init__(self, chunk_s: float = 0.05, realtime: bool = True, **kwargs):
        super().__init__(**kwargs)
        self.chunk_s, self.realtime = chunk_s, realtime
        self.streams: list[FakeRealtimeStream] = []

    def open_realtime(self, spec: RealtimeSpec) -> FakeRealtimeStream:
        if not self.realtime:
            raise RealtimeUnavailable()
        plan = plan_realtime(spec.prompt, spec.width, spec.height, spec.seed, spec.num_frames, spec.negative_prompt,
                             spec.extra, self.defaults)
        if not self._lock.acquire(blocking=False):
            raise RealtimeBusy()
        stream = FakeRealtimeStream(spec, plan.chunks, self.chunk_s, self._lock.release)
        self.streams.append(stream)
        return stream
