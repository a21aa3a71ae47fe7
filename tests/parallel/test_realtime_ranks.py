"""A real-time session under Ulysses 2 (the clean K/V cache per head shard, the causal core inside the all-to-all)
gives the one-rank session's frames and audio (gloo ranks, 1 thread each)."""

from __future__ import annotations

import numpy as np
import pytest
from rank_harness import run_ranks
from realtime_sessions import realtime_cases
from tiny_parallel import PARALLEL_DIT

from h3serve.rules import realtime as rt
from h3serve.tools.tiny_adapter import write_taomate_adapter

pytestmark = pytest.mark.slow


def test_ulysses_2_equals_one_rank(parallel_checkpoint, tmp_path):
    lora = write_taomate_adapter(tmp_path / "taomate", dict(PARALLEL_DIT), rank=4)
    ranks = run_ranks(2, realtime_cases, parallel_checkpoint, str(lora), 125)  # two requests: 8 chunks
    (frames, audio), (u_frames, u_audio) = ranks[0]["reference"], ranks[0]["ulysses"]
    assert frames.shape == (rt.session_frames(8), 64, 64, 3) and u_frames.shape == frames.shape
    assert ranks[0]["heads"] == ranks[1]["heads"] == 2 and ranks[1]["ulysses"] == 8  # rank 1 delivers no media
    # the same math per head shard; the attention kernels' blocking may differ in the last bits
    assert np.abs(u_frames.astype(int) - frames.astype(int)).max() <= 1
    np.testing.assert_allclose(u_audio, audio, atol=1e-4)
