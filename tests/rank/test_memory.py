"""Per-request peak memory: sampled during the request, so a small request after a big one reports small."""

from __future__ import annotations

import mmap
import time

import numpy as np
import torch

from h3serve.rank.memory import PeakMemory


def _resident(n_bytes: int) -> mmap.mmap:
    """`n_bytes` of new resident memory, returned to the system on `del`: an anonymous mapping with every page written.
    A torch block comes from the C heap, which may keep freed memory resident and hand it to the next block: in a full
    `make test` worker the first test's 256 MiB stayed resident after `del` and the second test's 192 MiB reused it,
    so neither RSS moved."""
    block = mmap.mmap(-1, n_bytes)
    np.frombuffer(block, dtype=np.uint8)[:: mmap.PAGESIZE] = 1
    return block


def _held_until_sampled(sampler, added: int, timeout_s: float = 60.0) -> None:
    """Wait until the sampler thread has seen `added` bytes more than at its start (on a busy 2-core host the
    thread may not run for a while, in a full `make test` beside the other worker for more than 10 s: a fixed sleep
    would measure the scheduler, not the sampler). Returns as soon as the sampler has seen it."""
    deadline = time.monotonic() + timeout_s
    while sampler.peak_bytes - sampler.start_bytes <= added and time.monotonic() < deadline:
        time.sleep(0.02)


def test_cpu_peak_is_per_request():
    with PeakMemory(torch.device("cpu")) as big:
        block = _resident(256 * 2**20)
        _held_until_sampled(big._rss, 200 * 2**20)
        del block
    with PeakMemory(torch.device("cpu")) as small:
        time.sleep(0.1)
    assert big.mb - small.mb > 200
    assert small.mb > 0


def test_rss_is_attributed_to_the_running_stage():
    from h3serve.rank.memory import RssSampler

    with RssSampler() as rss:
        with rss.stage("text_encode"):
            time.sleep(0.05)
        with rss.stage("video_decode") as stage:
            block = _resident(192 * 2**20)
            _held_until_sampled(stage, 150 * 2**20)
            del block
        with rss.stage("mux"):
            time.sleep(0.05)
    assert list(rss.stages) == ["text_encode", "video_decode", "mux"]
    assert rss.stages["video_decode"].added_bytes > 150 * 2**20
    assert rss.stages["text_encode"].added_bytes < 100 * 2**20
    span = rss.window(("audio_decode", "video_decode", "mux"))
    assert span.start_bytes == rss.stages["video_decode"].start_bytes
    assert span.peak_bytes == max(rss.stages["video_decode"].peak_bytes, rss.stages["mux"].peak_bytes)
    assert rss.window(("audio_decode",)) is None
