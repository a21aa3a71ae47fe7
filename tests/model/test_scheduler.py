"""The flow schedule and Euler step against the spec's table and diffusers' MiniMaxH3Scheduler.

h3serve's N counts forwards: FlowSchedule.shifted(N) is the reference's set_timesteps(N + 1)."""

from __future__ import annotations

import pytest
import torch
from diffusers import MiniMaxH3Scheduler

from h3serve.model.scheduler import FlowSchedule, scale_noise


@pytest.mark.parametrize(
    "n, shift, sigmas",
    [
        (3, 12.0, [1, 0.96, 0.857143, 0]),
        (3, 3.0, [1, 0.857143, 0.6, 0]),
        (7, 12.0, [1, 0.986301, 0.967742, 0.941176, 0.9, 0.827586, 0.666667, 0]),
        (7, 3.0, [1, 0.947368, 0.882353, 0.8, 0.692308, 0.545455, 0.333333, 0]),
        (4, 6.0, [1, 0.947368, 0.857143, 0.666667, 0]),  # a Turbo LoRA's 4 steps at shift 6
    ],
)
def test_spec_table(n, shift, sigmas):
    s = FlowSchedule.shifted(n, shift)
    assert s.sigmas.tolist() == pytest.approx(sigmas, abs=1e-6)
    assert len(s) == n  # N forwards over N + 1 grid points


@pytest.mark.parametrize("n", [1, 2, 7, 49, 50, 136, 200])
@pytest.mark.parametrize("shift", [12.0, 3.0, 1.0, 5.5])
def test_matches_diffusers_bitwise(n, shift):
    ref = MiniMaxH3Scheduler(shift=shift)
    ref.set_timesteps(n + 1)  # diffusers counts sigma points
    ours = FlowSchedule.shifted(n, shift)
    assert len(ref.timesteps) == len(ours) == n
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
    with pytest.raises(ValueError, match="steps counts denoiser forwards and must be >= 1"):
        FlowSchedule.shifted(0, 12.0)


def test_final_step_returns_denoised_estimate():
    s = FlowSchedule.shifted(1, 12.0)
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
    for n in range(1, 201):
        assert len(FlowSchedule.shifted(n, shift)) == n


FASTH3 = (0.999, 0.749, 0.5, 0.25, 0.0)


@pytest.mark.parametrize(
    "shift, sigmas",
    [(12.0, (0.99992, 0.97283, 0.92308, 0.8, 0.0)), (3.0, (0.99967, 0.89952, 0.75, 0.5, 0.0))],
    ids=["video", "audio"],
)
def test_pinned_positions_fasth3(shift, sigmas):
    s = FlowSchedule.shifted(4, shift, FASTH3)
    assert len(s) == 4 and [round(x, 5) for x in s.sigmas.tolist()] == list(sigmas)
    # The fp32 shift of the positions, elementwise (no linspace, no collapsing), and t = 1 - sigma per forward.
    base = torch.tensor(FASTH3, dtype=torch.float32)
    assert torch.equal(s.sigmas, shift * base / (1 + (shift - 1) * base))
    assert torch.equal(s.timesteps, 1.0 - s.sigmas[:-1])


def test_pinned_positions_refused():
    with pytest.raises(ValueError, match="5 pinned positions do not make 3 forwards"):
        FlowSchedule.shifted(3, 12.0, FASTH3)
    with pytest.raises(ValueError, match="collapse under shift"):
        FlowSchedule.shifted(2, 100.0, (1.0, 0.99999999, 0.0))
