"""DiT block cache through cache-dit: the DBCache policy step by step, the request's `quality`, the heads always
run, the refusals."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from h3serve.accel.cache import (
    HIGH,
    CacheConfigError,
    CacheProfile,
    CacheStats,
    DitBlockCache,
    block_cache,
    profile_for,
)
from h3serve.rules.request import GenerationRequest
from h3serve.rules.validate import RequestError, validate


class AddBlock(nn.Module):
    """x -> x + 1 + drift·calls (the first block's residual is what the cache compares), counting its calls."""

    def __init__(self, drift: float = 0.0):
        super().__init__()
        self.drift, self.calls = drift, 0

    def forward(self, x: torch.Tensor, *args: object) -> torch.Tensor:
        self.calls += 1
        return x + 1.0 + self.drift * self.calls


class ToyDiT(nn.Module):
    """Calls its blocks as H3Transformer does: `x = block(x, *args)`, then a head after the loop."""

    def __init__(self, blocks: list[AddBlock]):
        super().__init__()
        self.transformer_blocks = nn.ModuleList(blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.transformer_blocks:
            x = block(x, "temb", "rotary")
        return 2 * x


def _steps(dit: ToyDiT, profile: CacheProfile, forwards: int) -> tuple[list[torch.Tensor], CacheStats]:
    with block_cache(dit, profile, forwards) as stats:
        outs = [dit(torch.zeros(3)) for _ in range(forwards)]
    return outs, stats


def test_high_profile_warms_up_then_caches_at_most_one_step_in_a_row():
    dit = ToyDiT([AddBlock() for _ in range(4)])
    outs, stats = _steps(dit, HIGH, 8)
    assert all(torch.equal(o, torch.full((3,), 8.0)) for o in outs)  # a cached step adds the stored residual
    # steps 0-3 warm up; 4 cached, 5 computed (at most 1 in a row), 6 cached, 7 computed
    assert (stats.cached_steps, stats.skipped, stats.evaluated) == (2, 6, 8 + 6 * 3)
    assert [b.calls for b in dit.transformer_blocks] == [8, 6, 6, 6]
    # Removed after the request: the plain loop again, every block every time.
    dit(torch.zeros(3))
    assert [b.calls for b in dit.transformer_blocks] == [9, 7, 7, 7]
    assert isinstance(dit.transformer_blocks[0], AddBlock) and len(dit.transformer_blocks) == 4


def test_a_changing_first_block_residual_is_never_cached():
    dit = ToyDiT([AddBlock(drift=0.5), AddBlock(), AddBlock()])
    _, stats = _steps(dit, dataclasses.replace(HIGH, max_warmup_steps=0, max_continuous_cached_steps=-1), 6)
    assert stats.skipped == 0 and stats.evaluated == 18 and stats.cached_steps == 0


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
    plan = validate(GenerationRequest(prompt="waves", steps=7, seed=3, duration_s=4, quality=quality), defaults)
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
    server = CacheProfile(residual_diff_threshold=10.0, max_warmup_steps=2, max_continuous_cached_steps=-1)
    pipeline.cache = DitBlockCache(server)  # what the rank side injects (--cache-backend cache_dit)
    try:
        cached, heads = _generate(pipeline, defaults, None)
        lossless, _ = _generate(pipeline, defaults, "lossless")
        pipeline.cache = DitBlockCache(None)  # without a server cache
        high, _ = _generate(pipeline, defaults, "high")  # installed per request
    finally:
        pipeline.cache = None
    stats = cached.block_cache
    evaluated, skipped, steps = stats.evaluated, stats.skipped, stats.cached_steps
    layers = len(pipeline.components.transformer.transformer_blocks)
    assert steps == 7 - 2 and skipped == steps * (layers - 1) and evaluated + skipped == 7 * layers
    assert heads == 7  # 7 forwards: every one ran the audio head, cached or not
    assert not torch.equal(cached.audio_latents, plain.audio_latents)
    assert lossless.block_cache is None
    assert torch.equal(lossless.video_latents, plain.video_latents)
    assert torch.equal(lossless.audio_latents, plain.audio_latents)
    assert high.block_cache is not None and high.block_cache.evaluated + high.block_cache.skipped == 7 * layers


def test_quality_high_is_refused_where_the_engine_cannot_cache(tiny_checkpoint):
    from h3serve.accel.cache_profile import cache_refusal
    from h3serve.config.engine_config import EngineConfig
    from h3serve.config.offload_config import OffloadConfig
    from h3serve.rank.model_runner import ModelRunner

    config = EngineConfig(model=tiny_checkpoint, threads=1, offload=OffloadConfig(streamed=frozenset({"dit"})))
    assert "layerwise offload" in cache_refusal(config)
    engine = ModelRunner(config)
    with pytest.raises(RequestError, match="quality=high .* not available with layerwise offload"):
        engine.plan(GenerationRequest(prompt="waves", duration_s=4, quality="high"))
    assert engine.plan(GenerationRequest(prompt="waves", duration_s=4, quality="lossless")).quality == "lossless"


def test_a_forced_refresh_restarts_cache_dits_warm_up():
    from h3serve.rules.cache_refresh import ForceRefresh

    profile = dataclasses.replace(HIGH, max_warmup_steps=2, residual_diff_threshold=10.0,
                                  max_continuous_cached_steps=-1)
    dit = ToyDiT([AddBlock() for _ in range(3)])
    with block_cache(dit, profile, 8) as plain:
        [dit(torch.zeros(3)) for _ in range(8)]
    with block_cache(dit, profile, 8, ForceRefresh(4)) as once:  # forwards 4 and 5 warm up again
        [dit(torch.zeros(3)) for _ in range(8)]
    assert (plain.cached_steps, once.cached_steps) == (6, 4)
