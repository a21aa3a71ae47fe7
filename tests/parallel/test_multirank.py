"""Every parallel layout against one rank, end to end on the tiny checkpoint (gloo ranks, 1 thread each).

Two sessions: 2 ranks (TP2, U2, R2, text-encoder TP2, VAE tile PP2, TP2 and U2 compiled, standalone tile
decodes) and 4 ranks (U2×R2, TP2×U2, each also with two outputs as one batch). The packed sequence (629 rows) is
divisible by none of the degrees, so padding is always exercised.
"""

from __future__ import annotations

import pytest
import torch
from rank_harness import run_ranks
from rank_sessions import packed_length, pipeline_cases, plan_for

from h3serve.checkpoint.resolver import read_layout

pytestmark = pytest.mark.slow

TOLERANCE = 1e-4
TWO_RANK_CASES = [
    ("tp2", {"tensor_parallel_size": 2}),
    ("u2", {"ulysses_degree": 2}),
    ("r2", {"ring_degree": 2}),
    ("text_encoder_tp2", {"text_encoder_tp_size": 2}),
    ("vae_tile_pp2", {"vae_patch_parallel_size": 2}),
    # regional torch.compile: collectives and the sequence-parallel attention stay eager islands
    ("tp2_compiled", {"tensor_parallel_size": 2, "compile_granularity": "regional"}),
    ("u2_compiled", {"ulysses_degree": 2, "compile_granularity": "regional"}),
    # TeaCache under Ulysses: each rank judges its own rows, the group MAX-reduces the decision (forward 1 reused)
    ("u2_teacache", {"ulysses_degree": 2, "cache_backend": "tea_cache", "cache_config": '{"rel_l1_thresh": 1e9}'}),
]
CACHED = ("u2_teacache",)  # compared with the same cache on one rank, not with the uncached reference
FOUR_RANK_CASES = [
    ("u2xr2", {"ulysses_degree": 2, "ring_degree": 2}),
    ("tp2xu2", {"tensor_parallel_size": 2, "ulysses_degree": 2}),
]
# What each rank must report as applied: (tp, ulysses, ring, text-encoder tp, vae tiles).
APPLIED = {
    "tp2": (2, 1, 1, 1, False),
    "u2": (1, 2, 1, 1, False),
    "r2": (1, 1, 2, 1, False),
    "text_encoder_tp2": (1, 1, 1, 2, False),
    "vae_tile_pp2": (1, 1, 1, 1, True),
    "tp2_compiled": (2, 1, 1, 1, False),
    "u2_compiled": (1, 2, 1, 1, False),
    "u2_teacache": (1, 2, 1, 1, False),
    "u2xr2": (1, 2, 2, 1, False),
    "tp2xu2": (2, 2, 1, 1, False),
}


@pytest.fixture(scope="module")
def two_ranks(parallel_checkpoint):
    return run_ranks(2, pipeline_cases, parallel_checkpoint, TWO_RANK_CASES, True)


@pytest.fixture(scope="module")
def four_ranks(parallel_checkpoint):
    return run_ranks(4, pipeline_cases, parallel_checkpoint, FOUR_RANK_CASES, False, True)


def test_packed_length_is_not_divisible_by_any_degree(parallel_checkpoint):
    length = packed_length(plan_for(read_layout(parallel_checkpoint).defaults()))
    assert length == 629 and all(length % d for d in (2, 3, 4))


def _check_latents(reference: dict, got: dict, name: str) -> None:
    assert got["applied"] == APPLIED[name]
    for key in ("video_latents", "audio_latents"):
        ref, mine = reference[key], got[key]
        assert mine.shape == ref.shape
        diff = (mine - ref).abs().max().item()
        assert diff <= TOLERANCE, f"{key}: max |diff| {diff:.3g} > {TOLERANCE}"
    assert reference["video_latents"].std() > 0.1  # a real signal, not a vacuous comparison


@pytest.mark.parametrize("name", [name for name, _ in TWO_RANK_CASES if name not in CACHED])
def test_two_rank_layouts_match_one_rank(two_ranks, name):
    for rank in two_ranks:  # every rank ends with the same latents
        _check_latents(two_ranks[0]["reference"], rank[name], name)


def test_teacache_ranks_agree_and_match_the_cache_on_one_rank(two_ranks):
    one_rank = two_ranks[0]["u2_teacache:one_rank"]
    assert one_rank["cached_steps"] == 1  # forward 0 computed, forward 1 reused the residual
    for rank in two_ranks:  # the same decision on every rank, and the same latents as one rank
        assert rank["u2_teacache"]["cached_steps"] == 1
        _check_latents(one_rank, rank["u2_teacache"], "u2_teacache")
    assert (two_ranks[0]["u2_teacache"]["video_latents"] - two_ranks[0]["reference"]["video_latents"]).abs().max() > 0


@pytest.mark.parametrize("name", [name for name, _ in FOUR_RANK_CASES])
def test_four_rank_hybrids_match_one_rank(four_ranks, name):
    for rank in four_ranks:
        _check_latents(four_ranks[0]["reference"], rank[name], name)


@pytest.mark.parametrize("name", [name for name, _ in FOUR_RANK_CASES])
def test_several_outputs_batch_through_every_parallel_family(four_ranks, name):
    """Two outputs as one DiT batch under TP, Ulysses and Ring: output 0 is the layout's own single run (seed 1),
    output 1 another video (seed 2), on every rank."""
    for rank in four_ranks:
        (video0, audio0), (video1, _) = rank[name]["several"]
        assert (video0 - rank[name]["video_latents"]).abs().max().item() <= 1e-5
        assert (audio0 - rank[name]["audio_latents"]).abs().max().item() <= 1e-5
        assert (video1 - video0).abs().max().item() > 0.1


def test_vae_tile_parallel_pipeline_output_is_bit_identical(two_ranks):
    rank0 = two_ranks[0]
    assert torch.equal(rank0["vae_tile_pp2"]["video"], rank0["reference"]["video"])
    assert two_ranks[1]["vae_tile_pp2"]["video"].shape[0] == 0  # only rank 0 assembles the frames


def test_vae_tile_parallel_decode_is_bit_identical(two_ranks):
    for case in two_ranks[0]["tile_decodes"]:
        assert case["parallel"].shape == case["reference"].shape
        assert torch.equal(case["parallel"], case["reference"])


def test_tensor_parallel_halves_parameter_bytes(two_ranks, capsys):
    tp1 = two_ranks[0]["reference"]["dit_bytes"]
    per_rank = [rank["tp2"]["dit_bytes"] for rank in two_ranks]
    ratio = per_rank[0] / tp1
    with capsys.disabled():
        print(f"\nDiT parameter bytes per rank: TP1 {tp1:,} | TP2 {per_rank} ({ratio:.3f} of TP1)")
    assert per_rank[0] == per_rank[1]
    assert 0.45 < ratio < 0.6  # the sharded projections dominate; embeddings and norms stay whole


def test_text_encoder_runs_sharded_on_the_first_ranks_only(two_ranks):
    whole = two_ranks[0]["reference"]["text_bytes"]
    sharded = [rank["text_encoder_tp2"]["text_bytes"] for rank in two_ranks]
    assert sharded[0] == sharded[1] < 0.8 * whole
    # Without text-encoder TP only rank 0 holds the encoder; the other ranks receive its output.
    assert two_ranks[0]["tp2"]["text_bytes"] == whole and two_ranks[1]["tp2"]["text_bytes"] == 0
