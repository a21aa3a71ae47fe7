"""Streamed decode on two gloo ranks: the VAE's clips tile-parallel, one at a time, into rank 0's MP4 — the same
bytes as the full decode under TP2, Ulysses 2 and rank-local DLO (each with VAE tile parallelism)."""

from __future__ import annotations

import pytest
import torch
from rank_harness import run_ranks
from stream_sessions import CASES, stream_cases

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ranks(tiny_checkpoint):
    return run_ranks(2, stream_cases, tiny_checkpoint, timeout_s=600)


def test_tile_parallel_chunks_concatenate_to_the_one_rank_decode(ranks):
    rank0, rank1 = ranks[0]["standalone"], ranks[1]["standalone"]
    assert torch.equal(rank0["streamed"], rank0["reference"]) and rank0["reference"].std() > 0.05
    assert rank0["pieces"] == 3 and rank1["pieces"] == 0  # only rank 0 receives chunks


@pytest.mark.parametrize("name", [name for name, _, _ in CASES])
def test_streamed_mp4_is_the_full_decodes_bytes(ranks, name):
    rank0 = ranks[0][name]
    assert rank0["streamed"] == rank0["full"] and len(rank0["full"]) > 1000
    assert all(rank[name]["streamed_frames"] == rank0["video_frames"] == 107 for rank in ranks)
