"""TeaCache (`--cache-backend tea_cache`): the decision step by step, the signal, a reused step's residual, the
forced refresh, the ranks' agreement, and whole requests on the tiny pipeline (lossless untouched, heads always
run)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from small_dit import random_small_dit

from h3serve.accel.cache import DitBlockCache
from h3serve.accel.cache_profile import TEACACHE_COEFFICIENTS, TeaCacheProfile
from h3serve.accel.teacache import TeaCacheLoop, TeaCacheState, tea_cache
from h3serve.rules.cache_refresh import ForceRefresh
from h3serve.rules.request import GenerationRequest
from h3serve.rules.validate import validate

LINEAR = TeaCacheProfile(rel_l1_thresh=0.5, coefficients=(1.0, 0.0))  # poly(d) = d: the accumulator sums d


def _run(state: TeaCacheState, scales: list[float], agree=None) -> list[bool]:
    """Decide for signals ones·scale; a computed step leaves a residual (as the loop does)."""
    out = []
    for scale in scales:
        compute = state.decide(torch.full((2, 3), scale), agree)
        if compute:
            state.residual = torch.zeros(2, 3)
        out.append(compute)
    return out


def test_accumulates_the_rescaled_change_and_resets_when_it_computes():
    state = TeaCacheState(LINEAR)
    # changes: -, 0.1, 0.2, 0.3, 0.1 -> accumulator 0.1, 0.3, 0.6 (>= 0.5: compute, reset), 0.1
    scales = [1.0, 1.1, 1.1 * 1.2, 1.1 * 1.2 * 1.3, 1.1 * 1.2 * 1.3 * 1.1]
    assert _run(state, scales) == [True, False, False, True, False]
    assert state.changes == pytest.approx([0.1, 0.2, 0.3, 0.1], rel=1e-5)
    assert state.accumulated == pytest.approx(0.1, rel=1e-5)
    # A different shape always computes (no previous signal to compare with), and resets.
    assert state.decide(torch.ones(4, 3)) and state.accumulated == 0.0


def test_the_fitted_polynomial_is_numpy_poly1d_in_its_order():
    profile = TeaCacheProfile()
    assert profile.rel_l1_thresh == 0.17 and profile.coefficients == TEACACHE_COEFFICIENTS
    for d in (0.0, 0.013, 0.05, 0.2):
        assert profile.rescale(d) == pytest.approx(float(np.poly1d(TEACACHE_COEFFICIENTS)(d)), rel=1e-12)


def test_a_forced_refresh_computes_its_forward_and_restarts_the_accumulator():
    never = TeaCacheProfile(rel_l1_thresh=1e9, coefficients=(1.0, 0.0))
    steps = [1.0 + 0.01 * i for i in range(7)]
    assert _run(TeaCacheState(never), steps) == [True] + [False] * 6
    assert _run(TeaCacheState(never, ForceRefresh(3)), steps) == [True, False, False, True, False, False, False]
    assert _run(TeaCacheState(never, ForceRefresh(3, "repeat")), steps) == [True, False, False, True, False, False,
                                                                            True]


def test_an_overruled_rank_computes_with_the_group_and_restarts_its_accumulator():
    state = TeaCacheState(LINEAR)
    assert _run(state, [1.0, 1.1], agree=lambda local: True) == [True, True]  # locally "reuse" at forward 1
    assert state.accumulated == 0.0 and state.decisions == [True, True]
    alone = TeaCacheState(LINEAR)
    assert _run(alone, [1.0, 1.1]) == [True, False] and alone.accumulated > 0


def _inputs(dit, rows: int = 10):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, rows, dit.config.hidden_size, generator=g)
    temb = dit.time_embedder(torch.tensor([0.9, 0.4]))
    idx = torch.randint(0, 6, (rows,), generator=g)  # timestep index · 3 + modality
    rotary = dit.rope(torch.randn(rows, 3, generator=g, dtype=torch.float64))
    return x, temb, idx, rotary


@torch.no_grad()
def test_the_signal_is_block_zeros_attention_input_and_a_reused_step_adds_the_stored_residual():
    dit = random_small_dit()
    x, temb, idx, rotary = _inputs(dit)
    seen = []
    handle = dit.transformer_blocks[0].attn.register_forward_pre_hook(lambda _, args: seen.append(args[0].clone()))
    dit.transformer_blocks[0](x, temb, idx, rotary)
    handle.remove()
    assert torch.equal(dit.transformer_blocks[0].modulated_input(x, temb, idx), seen[0])

    loop = TeaCacheLoop(TeaCacheState(TeaCacheProfile(rel_l1_thresh=1e9)))
    first = loop(dit, x, temb, idx, rotary)
    assert torch.equal(first, dit.run_blocks(x, temb, idx, rotary))
    x2 = x + 0.01
    reused = loop(dit, x2, temb, idx, rotary)
    assert torch.equal(reused, x2 + (first - x)) and not torch.equal(reused, dit.run_blocks(x2, temb, idx, rotary))
    stats = loop.stats(len(dit.transformer_blocks))
    assert (stats.evaluated, stats.skipped, stats.cached_steps) == (2, 2, 1)


def test_a_request_under_teacache_runs_every_head_and_leaves_the_plain_loop(tiny_pipeline):
    pipeline, defaults = tiny_pipeline
    dit = pipeline.components.transformer
    layers = len(dit.transformer_blocks)
    server = dataclasses.replace(defaults, server_cache="tea_cache")
    plan = validate(GenerationRequest(prompt="waves", steps=4, seed=3, duration_s=4, force_refresh_step_hint=2,
                                      force_refresh_step_policy="repeat"), server)
    heads = []
    handle = dit.audio_proj_out.register_forward_hook(lambda *_: heads.append(1))
    pipeline.cache = DitBlockCache(TeaCacheProfile(rel_l1_thresh=1e9), dit)  # reuse whenever allowed
    try:
        cached = pipeline.generate(plan)
    finally:
        pipeline.cache = None
        handle.remove()
    assert dit.block_loop is None  # removed after the request
    stats = cached.block_cache  # forwards 0 and 2 computed (the first, and the refresh), 1 and 3 reused
    assert (stats.cached_steps, stats.skipped, stats.evaluated) == (2, 2 * layers, 2 * layers)
    assert len(heads) == 4  # the output norm and both heads ran on every forward, reused or not
    assert cached.video_latents.std() > 0.1 and torch.isfinite(cached.audio_latents).all()


def test_teacache_leaves_the_ref2va_dit_alone():
    dit, other = random_small_dit(), random_small_dit()
    cache = DitBlockCache(TeaCacheProfile(), dit)
    with cache.for_request(other, None, 4) as stats:
        assert stats is None and other.block_loop is None
    with cache.for_request(dit, None, 4) as stats:
        assert stats is not None and dit.block_loop is not None
    with cache.for_request(dit, "lossless", 4) as stats:
        assert stats is None
    with pytest.raises(RuntimeError, match="already runs under a step cache"), tea_cache(dit, TeaCacheProfile()):
        with tea_cache(dit, TeaCacheProfile()):
            pass
