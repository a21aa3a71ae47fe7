"""The measured engine's conventions (h3serve.offload.measured_engine): each term on its own, against the
released architecture on the meta device, and that h3serve's own plans never carry them."""

from __future__ import annotations

from dataclasses import replace

import pytest

from h3serve.config.offload_config import OffloadConfig
from h3serve.offload import activations
from h3serve.offload.activations import RequestShape
from h3serve.offload.inventory import EMBEDDING, RELEASED, build_inventory
from h3serve.offload.measured_engine import (
    H3SERVE,
    TEXT_ENCODER_LAYERS,
    ULYSSES_EXCHANGE,
    VLLM_OMNI,
    WHOLE_VIDEO_COPIES,
    check_engine,
    communicators,
    retains_denoise_cache,
)
from h3serve.offload.placement_plan import GiB
from h3serve.offload.planner import Runtime, plan_placement
from h3serve.parallel.degrees import ParallelDegrees

MiB = 2**20
VIDEO = RequestShape(1344, 768, 124, "t2va")
QUARTET = ParallelDegrees(tensor_parallel=2, ulysses=2, text_encoder_tp=4, vae_patch_parallel=4, world_size=4)
EMBEDDING_BYTES = 151_936 * 5_120 * 2  # Qwen3-VL-32B's token embedding in bf16


@pytest.fixture(scope="module")
def one_gpu():
    return {e: build_inventory(RELEASED, dits=("transformer",), engine=e) for e in (H3SERVE, VLLM_OMNI)}


@pytest.fixture(scope="module")
def quartet():
    return {e: build_inventory(RELEASED, QUARTET, ("transformer",), engine=e) for e in (H3SERVE, VLLM_OMNI)}


def test_vllm_omni_holds_the_whole_video_vae_in_fp32(one_gpu):
    vae, own = one_gpu[VLLM_OMNI].ranks[0]["vae"], one_gpu[H3SERVE].ranks[0]["vae"]
    assert vae.params == own.params == 2_603_868_984
    assert vae.params * 4 <= vae.total_bytes < vae.params * 4 + MiB  # every parameter fp32 (+ 32 B of buffers)
    assert vae.total_bytes / GiB == pytest.approx(9.70, abs=0.01)
    assert own.total_bytes / GiB == pytest.approx(5.19, abs=0.01)


def test_vllm_omni_keeps_fifty_encoder_layers_and_cuts_the_embedding(one_gpu, quartet):
    text, own = one_gpu[VLLM_OMNI].ranks[0]["text_encoder"], one_gpu[H3SERVE].ranks[0]["text_encoder"]
    layers = text.group("language_model.layers").block_bytes
    assert len(layers) == TEXT_ENCODER_LAYERS == 50 and len(own.group("language_model.layers").block_bytes) == 51
    assert own.total_bytes - text.total_bytes == layers[-1]  # one layer fewer; one rank: the embedding whole
    assert text.base_bytes == own.base_bytes
    cut, whole = quartet[VLLM_OMNI].ranks[0]["text_encoder"], quartet[H3SERVE].ranks[0]["text_encoder"]
    assert whole.base_bytes - cut.base_bytes == EMBEDDING_BYTES * 3 // 4  # vocab-parallel over 4 encoder ranks
    assert EMBEDDING.startswith("language_model.")


def test_whole_video_decode_is_four_fp32_videos_on_every_rank(quartet):
    inv = quartet[VLLM_OMNI]
    video = 3 * 124 * 1344 * 768 * 4
    per_rank = [activations.stage_activations(inv, r, "video_decode", VIDEO, "transformer") for r in range(4)]
    assert len(set(per_rank)) == 1  # the tile gather is an all-gather: every rank stitches the whole video
    assert WHOLE_VIDEO_COPIES * video < per_rank[0] < WHOLE_VIDEO_COPIES * video + GiB // 2  # + a tile's decoder
    longer = activations.stage_activations(inv, 0, "video_decode", replace(VIDEO, num_frames=209), "transformer")
    assert longer - per_rank[0] == WHOLE_VIDEO_COPIES * 3 * (209 - 124) * 1344 * 768 * 4  # grows with the video
    # h3serve's own streamed decode holds one clip, whatever the length.
    own = activations.stage_activations(quartet[H3SERVE], 0, "video_decode", VIDEO, "transformer")
    assert own < GiB


def test_the_ulysses_exchange_is_counted_for_both_engines(quartet):
    cfg = quartet[H3SERVE].dits["transformer"]
    rows = -(-VIDEO.seq_len // 2)
    unit = rows * cfg.num_attention_heads // 2 * cfg.attention_head_dim * 2  # one [rows, heads/TP, Dh] bf16 tensor
    own = activations.denoise(cfg, QUARTET, VIDEO, 2, engine=H3SERVE)
    vllm = activations.denoise(cfg, QUARTET, VIDEO, 2, engine=VLLM_OMNI)
    assert own - vllm == (ULYSSES_EXCHANGE[H3SERVE] - ULYSSES_EXCHANGE[VLLM_OMNI]) * unit
    no_ulysses = replace(QUARTET, ulysses=1, world_size=2, text_encoder_tp=2, vae_patch_parallel=2)
    assert activations.denoise(cfg, no_ulysses, VIDEO, 2, engine=H3SERVE) == activations.denoise(
        cfg, no_ulysses, VIDEO, 2, engine=VLLM_OMNI
    )


def test_vllm_omni_makes_a_sequence_group_beside_its_ulysses_group():
    assert communicators(VLLM_OMNI, QUARTET, 0) == ("world", "tp", "ulysses", "text_encoder", "sp")
    assert communicators(H3SERVE, QUARTET, 0) == ("world", "tp", "ulysses", "text_encoder")
    hybrid = ParallelDegrees(ulysses=2, ring=2, world_size=4)  # h3serve makes its own sequence group here too
    assert communicators(VLLM_OMNI, hybrid, 0) == communicators(H3SERVE, hybrid, 0)
    tp2 = ParallelDegrees(tensor_parallel=2, text_encoder_tp=2, world_size=2)
    assert communicators(VLLM_OMNI, tp2, 1) == ("world", "tp", "text_encoder")


def test_the_denoise_cache_stays_reserved_through_vllm_omnis_decode_only_with_the_vae_resident(quartet):
    assert retains_denoise_cache(VLLM_OMNI, "video_decode", vae_staged=False)
    assert not retains_denoise_cache(VLLM_OMNI, "video_decode", vae_staged=True)
    assert not retains_denoise_cache(VLLM_OMNI, "denoise", vae_staged=False)
    assert not retains_denoise_cache(H3SERVE, "video_decode", vae_staged=False)
    runtime = Runtime(memo=False, compiled=True)
    plan = plan_placement(quartet[VLLM_OMNI], OffloadConfig(), VIDEO, runtime=runtime)
    decode, denoise = plan.ranks[0].stage("video_decode"), plan.ranks[0].stage("denoise")
    assert decode.overhead["retained_cache"] == denoise.activations
    staged = OffloadConfig(staged=frozenset({"vae", "audio_vae"}))
    assert "retained_cache" not in plan_placement(quartet[VLLM_OMNI], staged, VIDEO, runtime=runtime).ranks[0].stage(
        "video_decode"
    ).overhead
    own = plan_placement(quartet[H3SERVE], OffloadConfig(), VIDEO, runtime=runtime)
    assert all("retained_cache" not in s.overhead for r in own.ranks for s in r.stages)


def test_an_unknown_engine_is_refused():
    with pytest.raises(ValueError, match="--as-engine: unknown engine 'sglang'; choose from: h3serve, vllm-omni"):
        check_engine("sglang")
    with pytest.raises(ValueError, match="unknown engine"):
        build_inventory(RELEASED, dits=("transformer",), engine="sglang")
