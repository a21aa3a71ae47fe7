"""Peak memory of one request: the CUDA allocator's high-water mark on GPU, the sampled resident set on CPU.

The process lifetime `ru_maxrss` never comes down, so it would report the largest request ever served (or the
model load) for every later request; sampling during the request measures that request.
"""

from __future__ import annotations

import threading

import psutil
import torch

RSS_INTERVAL_S = 0.02


class RssSampler:
    """Peak resident set size of this process and its descendants (rank processes), sampled every 20 ms."""

    def __init__(self, interval_s: float = RSS_INTERVAL_S):
        self.interval_s = interval_s
        self._process = psutil.Process()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.peak_bytes = 0
        self.start_bytes = 0  # at __enter__: what the request's peak adds to

    def _sample(self) -> int:
        total = 0
        for p in [self._process, *self._process.children(recursive=True)]:
            try:
                total += p.memory_info().rss
            except psutil.Error:  # a child that just exited
                pass
        return total

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.peak_bytes = max(self.peak_bytes, self._sample())

    def __enter__(self) -> RssSampler:
        self.peak_bytes = self.start_bytes = self._sample()
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="rss-sampler", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.peak_bytes = max(self.peak_bytes, self._sample())


class PeakMemory:
    """Context manager measuring one request's peak on `device` (see the module docstring)."""

    def __init__(self, device: torch.device):
        self.device = device
        self._rss = RssSampler()
        self.peak_bytes = 0
        self.start_bytes = 0  # at __enter__: what the request's peak adds to

    def __enter__(self) -> PeakMemory:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self._rss.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.device.type == "cuda":
            self.peak_bytes = torch.cuda.max_memory_allocated(self.device)
        else:
            self._rss.__exit__(*exc)
            self.peak_bytes = self._rss.peak_bytes

    @property
    def mb(self) -> float:
        return self.peak_bytes / 2**20
