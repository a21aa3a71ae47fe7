"""Polling helper for tests that wait on background work (threads, servers)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(predicate: Callable[[], T], timeout_s: float = 20.0, what: str = "condition",
               interval_s: float = 0.01) -> T:
    """The first truthy value of `predicate()`; AssertionError naming `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(interval_s)
    raise AssertionError(f"timed out waiting for {what}")
