"""A logging filter that lets through a few lines per cause per window, then counts what it drops.

A flood of hostile clients (thousands of malformed requests a second) must not grow the log by hundreds of MB.
"""

from __future__ import annotations

import logging
import threading
import time

WINDOW_S = 10.0
BURST = 5  # lines per cause (logger + message template) per window


class RateLimitFilter(logging.Filter):
    def __init__(self, window_s: float = WINDOW_S, burst: int = BURST):
        super().__init__()
        self.window_s = window_s
        self.burst = burst
        self._lock = threading.Lock()
        self._windows: dict[tuple[str, str], tuple[float, int]] = {}  # cause -> (window start, lines in it)

    def filter(self, record: logging.LogRecord) -> bool:
        cause = (record.name, str(record.msg))
        now = time.monotonic()
        with self._lock:
            start, count = self._windows.get(cause, (now, 0))
            if now - start >= self.window_s:
                if count > self.burst:
                    record.msg = f"{record.msg} [{count - self.burst} similar lines suppressed]"
                start, count = now, 0
            count += 1
            self._windows[cause] = (start, count)
            if len(self._windows) > 10_000:  # causes are templates, few; this only bounds a pathological caller
                self._windows.clear()
        return count <= self.burst
