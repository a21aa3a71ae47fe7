"""FP8 on two CPU ranks (gloo, 1 thread each): DiT TP2 + text-encoder TP2 in FP8 against one-rank FP8 (within
1e-5 of the output's range: the shards hold exactly the one-rank FP8 weights, only the reduction order differs),
and FP8 blocks streamed by DLO all-gather (FP8 bytes on the wire) byte-identical to resident FP8 under Ulysses 2."""

from __future__ import annotations

import pytest
from offload_sessions import dlo
from rank_harness import run_ranks
from rank_sessions import fp8_cases

from h3serve.config.quantization_config import parse_quantization

pytestmark = pytest.mark.slow

FP8 = parse_quantization("fp8", None)
CASES = [
    ("tp2", {"tensor_parallel_size": 2, "text_encoder_tp_size": 2, "quantization": FP8}),
    ("u2", {"ulysses_degree": 2, "quantization": FP8}),
    ("u2_dlo_allgather", {"ulysses_degree": 2, "quantization": FP8, "offload": dlo("allgather")}),
]


@pytest.fixture(scope="module")
def ranks(parallel_checkpoint):
    return run_ranks(2, fp8_cases, parallel_checkpoint, CASES, FP8, timeout_s=600)


def test_tp2_fp8_matches_one_rank_fp8(ranks):
    reference = ranks[0]["reference"]
    for rank in ranks:
        for key in ("video_latents", "audio_latents"):
            ref, got = reference[key], rank["tp2"][key]
            span = (ref.max() - ref.min()).item()
            assert span > 0.1 and (got - ref).abs().max().item() <= 1e-5 * span, key
        assert rank["tp2"]["fp8_layers"] > 0


def test_fp8_streamed_by_dlo_allgather_is_byte_identical(ranks):
    for rank in ranks:
        for key in ("video_latents", "audio_latents"):
            assert rank["u2_dlo_allgather"][key].numpy().tobytes() == rank["u2"][key].numpy().tobytes(), key
