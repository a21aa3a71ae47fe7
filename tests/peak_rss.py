"""The peak resident memory of a block of code in this process (Linux): `/proc/self/clear_refs` resets the
high-water mark (VmHWM) to the current RSS, so the peak of what runs afterwards is read without a new process."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path


def _status_mib(key: str) -> float:
    return int(re.search(rf"{key}:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1)) / 1024


@dataclass
class Peak:
    grown_mib: float = 0.0  # the peak RSS inside the block above the RSS at its start


@contextlib.contextmanager
def peak_rss() -> Iterator[Peak]:
    peak = Peak()
    start = _status_mib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")
    try:
        yield peak
    finally:
        peak.grown_mib = _status_mib("VmHWM") - start
