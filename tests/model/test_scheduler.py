"""The flow schedule and Euler step against the spec's table and diffusers' MiniMaxH3Scheduler."""

from __future__ import annotations

import pytest
import torch
from diffusers import MiniMaxH3Scheduler

from h3serve.model.scheduler import FlowSchedule, scale_noise


@pytest.mark.parametrize(
    "n, shift, sigmas",
    [
        (4, 12.0, [1, 0.96, 0.857143, 0]),
        (4, 3.0, [1, 0.857143, 0.6, 0]),
        (8, 12.0, [1, 0.986301, 0.967742, 0.941176, 0.9, 0.827586, 0.666667, 0]),
        (8, 3.0, [1, 0.947368, 0.882353, 0.8, 0.692308, 0.545455, 0.333333, 0]),
    ],
)
def test_spec_table(n, shift, sigmas):
    s = FlowSchedule.shifted(n, shift)
    assert s.sigmas.tolist() == pytest.approx(sigmas, abs=1e-6)
    assert len(s) == n - 1  # N grid points, N - 1 forwards


@pytest.mark.parametrize("n", [2, 3, 8, 50, 137])
@pytest.mark.parametrize("shift", [12.0, 3.0, 1.0, 5.5])
def test_matches_diffusers_bitwise(n, shift):
    ref = MiniMaxH3Scheduler(shift=shift)
    ref.set_timesteps(n)
    ours = FlowSchedule.shifted(n, shift)
    assert torch.equal(ours.sigmas, ref.sigmas) and torch.equal(ours.timesteps, ref.timesteps)
    g = torch.Generator().manual_seed(n)
    x = torch.randn(5, 7, generator=g)
    y = x.clone()
    for i, t in enumerate(ref.timesteps):
        v = torch.randn(5, 7, generator=g)
        x = ref.step(v, t, x, return_dict=False)[0]
        y = ours.step(v, i, y)
    assert torch.equal(x, y)


def test_one_step_runs_one_forward():
    assert len(FlowSchedule.shifted(1, 12.0)) == 1
    assert FlowSchedule.shifted(1, 12.0).sigmas.tolist() == [1.0, 0.0]


def test_final_step_returns_denoised_estimate():
    s = FlowSchedule.shifted(2, 12.0)
    x, v = torch.randn(3), torch.randn(3)
    assert torch.allclose(s.step(v, 0, x), x + v)  # t = 0, sigma 1 -> 0: x0 = x + v


def test_scale_noise_and_invalid_shift():
    x0, n = torch.ones(2), torch.zeros(2)
    assert scale_noise(x0, 0.999, n).tolist() == pytest.approx([0.999, 0.999])
    with pytest.raises(ValueError):
        FlowSchedule.shifted(4, 0.0)


@pytest.mark.parametrize("shift", [0.01, 1.0, 3.0, 12.0, 100.0])
def test_every_allowed_shift_keeps_every_step(shift):
    """Within the request limits (0 < shift <= 100), no grid point collapses: video and audio stay in step."""
    for n in range(2, 201):
        assert len(FlowSchedule.shifted(n, shift)) == n - 1
