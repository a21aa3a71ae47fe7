"""Synchronous requests wait for a queue slot instead of failing at once.

The rule: a `POST /v1/videos/sync` that finds the queue full (`--max-queue` outputs waiting) joins a line and is
queued, in arrival order, as soon as a slot frees, all within its own `--sync-timeout` (one deadline, counted from
when the request is ready to queue, its body read and checked, covers the wait for a slot and the run). At most
`--max-queue` sync requests stand in the line; beyond that, or when the deadline passes in the line, the answer is
the bounded queue's 429 `queue_full` with `Retry-After`. Async jobs (`POST /v1/videos`, remix, edits, extensions)
never wait: their client polls anyway, so a full queue is a 429 at once. A client that disconnects leaves the
line; a shutdown answers the line 503 `shutting_down`.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from starlette.requests import ClientDisconnect

from h3serve.engine.jobs.types import QueueFull

POLL_S = 0.05  # the head of the line retries this often (one queue count in the thread pool per retry)

T = TypeVar("T")


@dataclass
class Deadline:
    """A sync request's one deadline: `timeout_s` after it is first asked for (when the job is ready to queue)."""

    timeout_s: float
    at: float | None = None  # time.monotonic()

    def start(self) -> float:
        if self.at is None:
            self.at = time.monotonic() + self.timeout_s
        return self.at


class SyncLine:
    """The line of sync requests waiting for a queue slot (one per server, on the event loop)."""

    def __init__(self, limit: int):
        self.limit = limit
        self.peak = 0  # the longest the line has been
        self._waiting: deque[object] = deque()

    @property
    def length(self) -> int:
        return len(self._waiting)

    def has_room(self) -> bool:
        return len(self._waiting) < self.limit

    async def enter(
        self,
        attempt: Callable[[], Awaitable[T]],
        deadline: float,
        disconnected: Callable[[], Awaitable[bool]],
    ) -> T:
        """`attempt()` (which raises `QueueFull` while the queue is full) once this request is at the head of the
        line and a slot is free; `QueueFull` if the line is full or `deadline` (time.monotonic) passes first."""
        if not self._waiting:
            try:
                return await attempt()
            except QueueFull:
                pass
        if not self.has_room():
            return await attempt()  # the queue's own 429 (or a slot that just freed)
        ticket = object()
        self._waiting.append(ticket)
        self.peak = max(self.peak, len(self._waiting))
        try:
            while True:
                if self._waiting[0] is ticket:
                    try:
                        return await attempt()
                    except QueueFull as e:
                        if time.monotonic() >= deadline:
                            raise QueueFull(e.depth, e.retry_after_s) from None
                elif time.monotonic() >= deadline:
                    return await attempt()
                if await disconnected():
                    raise ClientDisconnect("a sync client left the line for a queue slot")
                await asyncio.sleep(POLL_S)
        finally:
            self._waiting.remove(ticket)
