"""The parent side of a real-time session (no torch): its settings, the stream of its chunks, its interactions.

`Executor.open_realtime(spec)` checks the settings (h3serve.rules.validate.realtime_plan), takes the executor's ranks
for the session (one session or job at a time per replica) and sends them `RealtimeOpen`; the `RealtimeStream` it
returns turns each chunk the ranks spool into one fragmented-MP4 segment (`SegmentWriter`: the first carries the
init segment) and ends with the writer's trailer. `interact` and `stop` reach the ranks at their next chunk
boundary; `close` aborts at once and frees the ranks for the next job.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

import numpy as np

from h3serve.errors import ClientError, RequestError, ServerError
from h3serve.media.raw import read_chunk
from h3serve.messages import (
    Event,
    JobCancelled,
    JobFailed,
    RealtimeChunkReady,
    RealtimeEnded,
    RealtimeInteract,
    RealtimeRead,
    RealtimeStop,
)
from h3serve.rules import limits
from h3serve.rules.validate.realtime_plan import RealtimePlan
from h3serve.rules.validate.resolve import check_prompt


@dataclass(frozen=True)
class RealtimeSpec:
    """One session's fixed settings, as `session.start` gives them (checked by `plan_realtime`)."""

    prompt: str
    width: int
    height: int
    seed: int
    num_frames: int
    negative_prompt: str | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)  # sampling_params / extra_params as given


@dataclass(frozen=True)
class Interaction:
    """A new prompt, from the next chunk boundary on (`transition_chunks` is accepted and, as vLLM-Omni does for
    TaoMate-H3, not applied: the switch is immediate)."""

    prompt: str
    event_id: str
    transition_chunks: int = 0


@dataclass(frozen=True)
class RealtimeChunk:
    index: int  # generation_chunk_index (the trailer: the number of media chunks)
    kind: Literal["media", "trailer"]
    frames: int
    audio_samples: int
    sample_rate: int
    segment: bytes  # fragmented MP4 (the first carries the init segment)
    started_event_ids: tuple[str, ...]
    active_event_ids: tuple[str, ...]
    completed_event_ids: tuple[str, ...]


class SegmentWriter(Protocol):
    """What encodes the chunks (h3serve.media.fragments.FragmentWriter)."""

    def segment(self, frames: np.ndarray, audio: np.ndarray) -> bytes: ...
    def finish(self) -> bytes: ...


SegmentWriterFactory = Callable[[int, int], SegmentWriter]  # (width, height) -> a writer for one session


class SessionHost(Protocol):
    """What a stream needs of its executor (h3serve.engine.executor.Executor)."""

    @property
    def spool_dir(self) -> Path: ...

    def send(self, message: object) -> None: ...
    def next_event_for(self, seq: int, deadline: float | None) -> Event: ...
    def failed(self, event: JobFailed) -> None: ...
    def abort(self, seq: int) -> None: ...


class RealtimeUnavailable(ClientError):
    """This server was started without --realtime-lora."""

    code = "realtime_unavailable"

    def __init__(self) -> None:
        super().__init__("this server runs no real-time sessions: start it with --realtime-lora DIR (a streaming LoRA)")


class RealtimeBusy(ServerError):
    """The replica runs a job or another session; try again after `retry_after_s`."""

    code = "busy"
    client_safe = True

    def __init__(self, retry_after_s: int = 5):
        super().__init__(f"the engine is busy with another job or session; retry in about {retry_after_s} s")
        self.retry_after_s = retry_after_s


class RealtimeStream:
    """One open session's chunks, in order, then its trailer (see the module docstring)."""

    def __init__(self, executor: SessionHost, seq: int, plan: RealtimePlan, writer: SegmentWriter,
                 release: Callable[[], None]):
        self.executor, self.seq, self.plan = executor, seq, plan
        self.writer = writer
        self._writer_open = True
        self._release = release
        self._state: Literal["running", "ended", "done"] = "running"
        self._chunks = 0

    @property
    def closed(self) -> bool:
        return self._state == "done"

    def interact(self, interaction: Interaction) -> None:
        """Queue a new prompt for the next chunk boundary (the last one queued before a boundary wins)."""
        if self._state != "running":
            raise RequestError("session", "the session has ended; it takes no more interactions")
        check_prompt(interaction.prompt, "interaction.event.prompt")
        if not isinstance(interaction.event_id, str) or not interaction.event_id:
            raise RequestError("interaction.event_id", "must be a non-empty string")
        self.executor.send(RealtimeInteract(self.seq, interaction.prompt, interaction.event_id))

    def stop(self) -> None:
        """End after the chunk in flight: `next_chunk` then gives the trailer, then None."""
        if self._state == "running":
            self.executor.send(RealtimeStop(self.seq))

    def next_chunk(self, timeout_s: float) -> RealtimeChunk | None:
        """The next chunk (blocking up to `timeout_s`: `TimeoutError` past it); None once the session is over."""
        if self._state == "done":
            return None
        if self._state == "ended":
            return self._trailer()
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                event = self.executor.next_event_for(self.seq, deadline)
            except TimeoutError:
                raise TimeoutError(f"no chunk within {timeout_s:g} s") from None
            except BaseException:
                self._finish()
                raise
            if isinstance(event, RealtimeChunkReady):
                return self._media(event)
            if isinstance(event, RealtimeEnded):
                self._state = "ended"
                return self._trailer()
            if isinstance(event, JobCancelled):
                self._finish()
                return None
            if isinstance(event, JobFailed):
                try:
                    self.executor.failed(event)  # raises, once the ranks are restarted where they must be
                finally:
                    self._finish()

    def close(self) -> None:
        """Abort now (idempotent): the ranks stop at their next chunk boundary and take the next job."""
        if self._state == "done":
            return
        if self._state == "running":
            self.executor.abort(self.seq)
        self._finish()

    def _media(self, event: RealtimeChunkReady) -> RealtimeChunk:
        frames, audio = read_chunk(event.path)
        os.unlink(event.path)
        self.executor.send(RealtimeRead(self.seq, event.index))
        segment = self.writer.segment(frames, audio)
        self._chunks += 1
        return RealtimeChunk(event.index, "media", event.frames, event.audio_samples, limits.AUDIO_SAMPLE_RATE,
                             segment, event.started_event_ids, event.active_event_ids, event.completed_event_ids)

    def _trailer(self) -> RealtimeChunk:
        segment = self._close_writer()
        self._finish()
        return RealtimeChunk(self._chunks, "trailer", 0, 0, limits.AUDIO_SAMPLE_RATE, segment, (), (), ())

    def _close_writer(self) -> bytes:
        if not self._writer_open:
            return b""
        self._writer_open = False
        return self.writer.finish()

    def _finish(self) -> None:
        if self._state != "done":
            self._state = "done"
            try:
                self._close_writer()  # an aborted session's encoders are closed too; their bytes go nowhere
            except Exception:  # noqa: BLE001 - the session is over whatever its encoder says
                pass
            for path in Path(self.executor.spool_dir).glob(f"chunk-{self.seq}-*.npz"):
                path.unlink(missing_ok=True)
            self._release()
