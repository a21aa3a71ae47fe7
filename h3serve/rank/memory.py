"""Peak memory of one request: the CUDA allocator's high-water mark on GPU, the sampled resident set on CPU.

The process lifetime `ru_maxrss` never comes down, so it would report the largest request ever served (or the
model load) for every later request; sampling during the request measures that request.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import psutil
import torch

RSS_INTERVAL_S = 0.02


@dataclass
class StageRss:
    """One stage's resident set: at its first start, and the highest sample while it (or a stage inside it) ran."""

    start_bytes: int
    peak_bytes: int

    @property
    def added_bytes(self) -> int:
        """What the stage's working set added to the resident set it started from."""
        return max(0, self.peak_bytes - self.start_bytes)


class RssSampler:
    """Peak resident set size of this process and its descendants (rank processes), sampled every 20 ms."""

    def __init__(self, interval_s: float = RSS_INTERVAL_S):
        self.interval_s = interval_s
        self._process = psutil.Process()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.peak_bytes = 0
        self.start_bytes = 0  # at __enter__: what the request's peak adds to
        self.stages: dict[str, StageRss] = {}  # in the order they first started
        self._open: list[StageRss] = []  # the stages running now (nested: outermost first)
        self._lock = threading.Lock()

    def _record(self, rss: int) -> None:
        with self._lock:
            self.peak_bytes = max(self.peak_bytes, rss)
            for stage in self._open:
                stage.peak_bytes = max(stage.peak_bytes, rss)

    @contextmanager
    def stage(self, name: str) -> Iterator[StageRss]:
        """Attribute the samples taken inside to stage `name` (a stage run twice keeps its first start)."""
        rss = self._sample()
        with self._lock:
            record = self.stages.setdefault(name, StageRss(rss, rss))
            self._open.append(record)
        self._record(rss)
        try:
            yield record
        finally:
            self._record(self._sample())
            with self._lock:
                self._open.remove(record)

    def window(self, names: tuple[str, ...]) -> StageRss | None:
        """Stages run one after another as one span: the RSS when the first began, the peak over all of them."""
        ran = [self.stages[n] for n in self.stages if n in names]
        if not ran:
            return None
        return StageRss(ran[0].start_bytes, max(s.peak_bytes for s in ran))

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
            self._record(self._sample())

    def __enter__(self) -> RssSampler:
        self.peak_bytes = self.start_bytes = self._sample()
        self.stages.clear()
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="rss-sampler", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._record(self._sample())


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
