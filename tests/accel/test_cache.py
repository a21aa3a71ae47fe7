"""DiT block cache: the DBCache policy step by step, the request's `quality`, the heads always run."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from h3serve.accel.cache import HIGH, BlockCache, CacheConfigError, CacheProfile, profile_for
from h3serve.request import GenerationRequest
from h3serve.validate import RequestError, validate


class AddBlock(nn.Module):
    """x -> x + step·scale + 1, counting its calls (the first block's residual is what the cache compares)."""

    def __init__(self, drift: float = 0.0):
        super().__init__()
        self.drift, self.calls = drift, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x + 1.0 + self.drift * self.calls


def test_high_profile_warms_up_then_caches_at_most_one_step_in_a_row():
    blocks = nn.ModuleList([AddBlock() for _ in range(4)])
    cache = BlockCache(HIGH)
    outs = [cache.run(blocks, torch.zeros(3)) for _ in range(8)]
    assert all(torch.equal(o, torch.full((3,), 4.0)) for o in outs)  # a cached step adds the stored residual
    # steps 0-3 warm up; 4 cached, 5 computed (at most 1 in a row), 6 cached, 7 computed
    assert (cache.cached_steps, cache.skipped, cache.evaluated) == (2, 6, 8 + 6 * 3)
    assert [b.calls for b in blocks] == [8, 6, 6, 6]


def test_a_changing_first_block_residual_is_never_cached():
    blocks = nn.ModuleList([AddBlock(drift=0.5), AddBlock(), AddBlock()])
    cache = BlockCache(dataclasses.replace(HIGH, max_warmup_steps=0, max_continuous_cached_steps=-1))
    for _ in range(6):
        cache.run(blocks, torch.zeros(2))
    assert cache.skipped == 0 and cache.evaluated == 18


def test_profiles_per_request_and_config_parsing():
    server = CacheProfile(residual_diff_threshold=0.1)
    assert profile_for(None, server) is server and profile_for(None, None) is None
    assert profile_for("lossless", server) is None and profile_for("high", None) == HIGH
    assert CacheProfile.from_json({"Bn_compute_blocks": 1}).Bn_compute_blocks == 1
    with pytest.raises(CacheConfigError, match="unknown keys taylorseer"):
        CacheProfile.from_json({"taylorseer": True})
    with pytest.raises(RequestError, match="quality: must be one of lossless, high"):
        validate(GenerationRequest(prompt="x", quality="medium"))


def _generate(pipeline, defaults, quality):
    plan = validate(GenerationRequest(prompt="waves", steps=8, seed=3, duration_s=4, quality=quality), defaults)
    heads = []
    handle = pipeline.components.transformer.audio_proj_out.register_forward_hook(lambda *_: heads.append(1))
    try:
        return pipeline.generate(plan), len(heads)
    finally:
        handle.remove()


def test_lossless_bypasses_the_server_cache_and_cached_steps_keep_the_audio_head(tiny_pipeline):
    pipeline, defaults = tiny_pipeline
    plain, _ = _generate(pipeline, defaults, None)
    assert plain.block_cache is None
    pipeline.cache = CacheProfile(residual_diff_threshold=10.0, max_warmup_steps=2, max_continuous_cached_steps=-1)
    try:
        cached, heads = _generate(pipeline, defaults, None)
        lossless, _ = _generate(pipeline, defaults, "lossless")
    finally:
        pipeline.cache = None
    evaluated, skipped, steps = cached.block_cache
    layers = len(pipeline.components.transformer.transformer_blocks)
    assert steps == 7 - 2 and skipped == steps * (layers - 1) and evaluated + skipped == 7 * layers
    assert heads == 7  # 8 grid points = 7 forwards: every one ran the audio head, cached or not
    assert not torch.equal(cached.audio_latents, plain.audio_latents)
    assert lossless.block_cache is None
    assert torch.equal(lossless.video_latents, plain.video_latents)
    assert torch.equal(lossless.audio_latents, plain.audio_latents)
    high, _ = _generate(pipeline, defaults, "high")  # installed per request without a server cache
    assert high.block_cache is not None and sum(high.block_cache[:2]) == 7 * layers
