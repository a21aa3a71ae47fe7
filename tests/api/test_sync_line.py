"""The line of sync requests waiting for a queue slot (h3serve/api/sync_line.py), without a server."""

from __future__ import annotations

import asyncio
import time

import pytest

from h3serve.api.sync_line import SyncLine
from h3serve.engine.jobs.types import QueueFull


class Queue:
    """`slots` free queue slots; each attempt takes one or raises QueueFull."""

    def __init__(self) -> None:
        self.slots = 0
        self.order: list[str] = []

    def attempt(self, name: str):
        async def take() -> str:
            if self.slots == 0:
                raise QueueFull(2, 1)
            self.slots -= 1
            self.order.append(name)
            return name

        return take


async def _never_disconnected() -> bool:
    return False


def test_waiters_get_slots_in_arrival_order_and_time_out_with_queue_full():
    async def scenario() -> tuple[list[str], float]:
        queue, line = Queue(), SyncLine(limit=3)
        far = time.monotonic() + 30
        waiters = []
        for name in ("a", "b", "c"):
            waiters.append(asyncio.create_task(line.enter(queue.attempt(name), far, _never_disconnected)))
            await asyncio.sleep(0.01)
        assert line.length == 3
        with pytest.raises(QueueFull):  # the line is full: the queue's own answer, at once
            await line.enter(queue.attempt("d"), far, _never_disconnected)
        for _ in range(3):
            queue.slots += 1
            await asyncio.sleep(0.2)
        await asyncio.gather(*waiters)
        start = time.monotonic()
        with pytest.raises(QueueFull):
            await line.enter(queue.attempt("late"), time.monotonic() + 0.3, _never_disconnected)
        return queue.order, time.monotonic() - start

    order, waited = asyncio.run(scenario())
    assert order == ["a", "b", "c"]
    assert 0.3 <= waited < 2 and SyncLine(1).length == 0
