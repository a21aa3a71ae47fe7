"""Real-time sessions on the job manager's replicas. A session holds a whole replica (its executor runs one session
or one job at a time): it is taken under the book's lock, as a runner takes a job, and until it is released that
replica's runner claims no job. The queue waits for the replica like for a long job."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from h3serve.engine.jobs.book import JobBook
from h3serve.engine.jobs.types import ExecutorLike, ShuttingDown
from h3serve.engine.realtime_stream import RealtimeBusy, RealtimeSpec, RealtimeStream


class SessionLease:
    """One replica held for one session: `open` starts the session on it, `release` gives the replica back to the
    queue (after the stream is closed; idempotent)."""

    def __init__(self, slots: SessionSlots, replica: int):
        self.slots, self.replica = slots, replica
        self._released = False

    def open(self, spec: RealtimeSpec) -> RealtimeStream:
        """The session's stream (blocking; `RequestError` for bad settings, `RealtimeUnavailable` without
        --realtime-lora, `RealtimeBusy` if the executor is still busy after all)."""
        return self.slots.executors[self.replica].open_realtime(spec)

    def release(self) -> None:
        if not self._released:
            self._released = True
            self.slots.release(self.replica)


class SessionSlots:
    """Which replicas the sessions hold (the book's `sessions`)."""

    def __init__(self, book: JobBook, executors: Sequence[ExecutorLike], retry_after_s: Callable[[], int]):
        self.book, self.executors, self.retry_after_s = book, executors, retry_after_s

    def reserve(self) -> SessionLease:
        """A replica that runs no job and no session, held from now on; `RealtimeBusy` (with a Retry-After from the
        recent jobs) when there is none, `ShuttingDown` once the manager stops."""
        with self.book.cond:
            if self.book.stopping:
                raise ShuttingDown("the server is shutting down")
            replica = self.book.reserve_session()
        if replica is None:
            raise RealtimeBusy(self.retry_after_s())
        return SessionLease(self, replica)

    def release(self, replica: int) -> None:
        self.book.release_session(replica)

