"""Per-request peak memory: sampled during the request, so a small request after a big one reports small."""

from __future__ import annotations

import time

import torch

from h3serve.rank.memory import PeakMemory


def test_cpu_peak_is_per_request():
    with PeakMemory(torch.device("cpu")) as big:
        block = torch.ones(64, 2**20)  # 256 MiB, touched
        time.sleep(0.1)
        del block
    with PeakMemory(torch.device("cpu")) as small:
        time.sleep(0.1)
    assert big.mb - small.mb > 200
    assert small.mb > 0
