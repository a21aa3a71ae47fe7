"""The RES multistep solver (`extra_params.sample_solver = res_multistep`) against an independent implementation of
ComfyUI's `res_multistep` at eta 0, written here from its published formula (comfy/k_diffusion/sampling.py: the
k-diffusion form in t = -log sigma, phi functions, nan_to_num, the ancestral split with eta 0), in float64."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from h3serve.model.conditioning import encode_visual_condition
from h3serve.model.pipeline_types import Conditioning
from h3serve.model.scheduler import FlowSchedule, FlowSolver, res_multistep_weights
from h3serve.rules.request import GenerationRequest, MediaRef
from h3serve.rules.validate import validate

BASE = {"prompt": "a red ball", "width": 32, "height": 32, "duration_s": 4, "seed": 3}


# -- ComfyUI's res_multistep, eta 0 (independent of h3serve) ------------------------------------------------------


def _t(sigma: torch.Tensor) -> torch.Tensor:
    return sigma.log().neg()


def _phi1(t: torch.Tensor) -> torch.Tensor:
    return torch.expm1(t) / t


def _phi2(t: torch.Tensor) -> torch.Tensor:
    return (_phi1(t) - 1.0) / t


def comfy_step(
    x: torch.Tensor,
    denoised: torch.Tensor,
    old_denoised: torch.Tensor | None,
    old_sigma_down: torch.Tensor | None,
    sigmas: torch.Tensor,
    i: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One iteration of the published loop body: (x_next, sigma_down). eta 0: sigma_down = sigma_{i+1}, no noise."""
    sigma, sigma_down = sigmas[i], sigmas[i + 1]
    if sigma_down == 0 or old_denoised is None:  # Euler on the Karras derivative
        d = (x - denoised) / sigma
        return x + d * (sigma_down - sigma), sigma_down
    t, t_old, t_next, t_prev = _t(sigma), _t(old_sigma_down), _t(sigma_down), _t(sigmas[i - 1])
    h = t_next - t
    c2 = (t_prev - t_old) / h
    b1 = torch.nan_to_num(_phi1(-h) - _phi2(-h) / c2, nan=0.0)
    b2 = torch.nan_to_num(_phi2(-h) / c2, nan=0.0)
    return (-h).exp() * x + h * (b1 * denoised + b2 * old_denoised), sigma_down


def comfy_res_multistep(model: Callable[[torch.Tensor, int], torch.Tensor], x: torch.Tensor,
                        sigmas: torch.Tensor) -> torch.Tensor:
    """ComfyUI's sampler loop: `model(x, i)` returns the clean estimate (ComfyUI's `denoised`) at sigma_i."""
    old_denoised = old_sigma_down = None
    for i in range(len(sigmas) - 1):
        denoised = model(x, i)
        x, sigma_down = comfy_step(x, denoised, old_denoised, old_sigma_down, sigmas, i)
        old_denoised, old_sigma_down = denoised, sigma_down
    return x


def velocity_field(target: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """A smooth, nonlinear data-ward velocity (the sampler sees it as the model's output)."""
    return lambda x: (target - x) + 0.3 * torch.sin(3 * x)


# -- the formula --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("steps, shift", [(1, 12.0), (2, 3.0), (3, 12.0), (8, 3.0), (50, 12.0), (200, 1.0)])
def test_weights_are_comfyuis_coefficients(steps, shift):
    sigmas = FlowSchedule.shifted(steps, shift).sigmas.double()
    weights = res_multistep_weights(sigmas)
    assert len(weights) == steps
    for i, w in enumerate(weights):
        if i == 0 or sigmas[i + 1] == 0:  # the first step and the step to sigma 0 are Euler
            assert w is None
            continue
        h = _t(sigmas[i + 1]) - _t(sigmas[i])
        c2 = (_t(sigmas[i - 1]) - _t(sigmas[i])) / h
        expected = (h * (_phi1(-h) - _phi2(-h) / c2), h * _phi2(-h) / c2)
        assert w == pytest.approx([float(e) for e in expected], rel=1e-9, abs=1e-12)
        # A constant estimate steps as Euler does: the weights sum to 1 - sigma_{i+1} / sigma_i.
        assert w[0] + w[1] == pytest.approx(1 - float(sigmas[i + 1] / sigmas[i]), abs=1e-12)


def test_phi2_series_near_zero_h():
    """Two sigmas 1e-7 apart: h below the series threshold; the series agrees with the exact value at 1e-5."""
    close = torch.tensor([0.9, 0.5, 0.5 * math.exp(-1e-7), 0.2, 0.0], dtype=torch.float64)
    series = res_multistep_weights(close)[1]
    exact = res_multistep_weights(torch.tensor([0.9, 0.5, 0.5 * math.exp(-2e-5), 0.2, 0.0], dtype=torch.float64))[1]
    assert series is not None and all(math.isfinite(w) for w in series)
    assert series[0] + series[1] == pytest.approx(1 - math.exp(-1e-7), rel=1e-6)
    assert exact is not None and exact[0] + exact[1] == pytest.approx(1 - math.exp(-2e-5), rel=1e-6)


# -- h3serve's sampler against ComfyUI's ----------------------------------------------------------------------------


@pytest.mark.parametrize("steps, shift", [(3, 12.0), (4, 3.0), (8, 3.0), (50, 12.0), (200, 12.0), (50, 1.0)])
def test_every_step_matches_comfyui(steps, shift):
    """Along a whole trajectory, each step from the same state and estimates equals ComfyUI's to 1e-6."""
    schedule = FlowSchedule.shifted(steps, shift)
    g = torch.Generator().manual_seed(steps)
    x = torch.randn(8, 256, generator=g)
    velocity = velocity_field(0.7 * torch.randn(8, 256, generator=g))
    solver = FlowSolver(schedule, "res_multistep")
    sigmas = schedule.sigmas.double()
    old = old_down = None
    for i in range(steps):
        v = velocity(x)
        denoised = schedule.denoised(v, i, x).double()
        expected, down = comfy_step(x.double(), denoised, old, old_down, sigmas, i)
        x = solver.step(v, i, x)
        assert (x.double() - expected).abs().max() <= 1e-6, f"step {i}"
        old, old_down = denoised, down


@pytest.mark.parametrize("steps, shift", [(3, 12.0), (3, 3.0), (4, 12.0)])
def test_a_short_trajectory_matches_comfyui(steps, shift):
    """The whole loop on recorded velocities (ComfyUI's model replays them: D = x + sigma·v), fp32 vs float64."""
    schedule = FlowSchedule.shifted(steps, shift)
    g = torch.Generator().manual_seed(7)
    x0 = torch.randn(4, 256, generator=g)
    velocity = velocity_field(0.7 * torch.randn(4, 256, generator=g))
    solver, x, recorded = FlowSolver(schedule, "res_multistep"), x0.clone(), []
    for i in range(steps):
        recorded.append(velocity(x))
        x = solver.step(recorded[-1], i, x)
    sigmas = schedule.sigmas.double()
    ours_reference = comfy_res_multistep(lambda y, i: y + sigmas[i] * recorded[i].double(), x0.double(), sigmas)
    assert (x.double() - ours_reference).abs().max() <= 1e-6


def test_one_step_is_euler_bit_for_bit_and_two_steps_too():
    """One forward (sigma 1 -> 0) is Euler; with two, the second ends at sigma 0: Euler as well, bit for bit."""
    for steps in (1, 2):
        schedule = FlowSchedule.shifted(steps, 12.0)
        g = torch.Generator().manual_seed(steps)
        x = y = torch.randn(6, 40, generator=g)
        solver = FlowSolver(schedule, "res_multistep")
        for i in range(steps):
            v = torch.randn(6, 40, generator=g)
            x, y = solver.step(v, i, x), schedule.step(v, i, y)
            assert torch.equal(x, y)


def test_three_or_more_steps_differ_from_euler():
    schedule = FlowSchedule.shifted(3, 12.0)
    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(6, 40, generator=g)
    velocity = velocity_field(torch.randn(6, 40, generator=g))
    out = {}
    for name in ("euler", "res_multistep"):
        solver, x = FlowSolver(schedule, name), x0.clone()
        for i in range(3):
            x = solver.step(velocity(x), i, x)
        out[name] = x
    assert (out["euler"] - out["res_multistep"]).abs().max() > 1e-3


def test_the_step_is_computed_in_fp32_and_returned_in_the_samples_dtype():
    schedule = FlowSchedule.shifted(3, 12.0)
    g = torch.Generator().manual_seed(1)
    states, estimates = torch.randn(3, 5, 16, generator=g), torch.randn(3, 5, 16, generator=g)
    low, full = FlowSolver(schedule, "res_multistep"), FlowSolver(schedule, "res_multistep")
    for i in range(3):
        x = states[i].bfloat16()
        out = low.step_from_x0(estimates[i].bfloat16(), i, x)
        assert out.dtype == torch.bfloat16
        assert torch.equal(out, full.step_from_x0(estimates[i].bfloat16().float(), i, x.float()).bfloat16())


def test_steps_run_in_order_and_unknown_names_are_refused():
    solver = FlowSolver(FlowSchedule.shifted(4, 12.0), "res_multistep")
    with pytest.raises(RuntimeError, match="steps run in order"):
        solver.step_from_x0(torch.zeros(3), 1, torch.zeros(3))
    with pytest.raises(ValueError, match="choose from euler, res_multistep"):
        FlowSolver(FlowSchedule.shifted(4, 12.0), "heun")


# -- the pipeline ----------------------------------------------------------------------------------------------------


def latents(pipeline, monkeypatch, defaults, cond=None, **kw):
    """(video, audio) latents of one request, without the decode."""
    monkeypatch.setattr(pipeline.decoder, "decode", lambda video, audio, clock, cache, *sink: (video, audio))
    return pipeline.generate(validate(GenerationRequest(**BASE, **kw), defaults), cond)


class Recorder:
    """Every FlowSolver the pipeline builds, with each step's (index, velocity, state) and output."""

    def __init__(self, monkeypatch):
        self.solvers: list[tuple[FlowSolver, list]] = []
        init, step = FlowSolver.__init__, FlowSolver.step
        recorder = self

        def recording_init(solver, schedule, name="euler", device=None):
            init(solver, schedule, name, device)
            recorder.solvers.append((solver, []))

        def recording_step(solver, velocity, index, sample):
            out = step(solver, velocity, index, sample)
            next(s for s in recorder.solvers if s[0] is solver)[1].append((index, velocity.clone(), sample.clone(),
                                                                           out.clone()))
            return out

        monkeypatch.setattr(FlowSolver, "__init__", recording_init)
        monkeypatch.setattr(FlowSolver, "step", recording_step)


def test_tiny_pipeline_matches_comfyui_on_recorded_velocities(tiny_pipeline, monkeypatch):
    """3 forwards on the tiny checkpoint: each modality's trajectory, replayed through ComfyUI's loop on its own
    shifted sigmas (video 12, audio 3) from the same noise, ends where h3serve's float32 trajectory does, to 4 float32
    ulps of the largest latent (~2.7e-6 here; an absolute 1e-6 failed at 1.003e-6 on an Intel Xeon, whose kernels
    round otherwise; Euler's update in its place ends 7.5 away)."""
    pipeline, defaults = tiny_pipeline
    recorder = Recorder(monkeypatch)
    latents(pipeline, monkeypatch, defaults, steps=3, sample_solver="res_multistep")
    assert [s.name for s, _ in recorder.solvers] == ["res_multistep"] * 2  # one solver state per modality
    for (solver, steps), shift in zip(recorder.solvers, (defaults.flow_shift, defaults.audio_flow_shift), strict=True):
        assert torch.equal(solver.schedule.sigmas.cpu(), FlowSchedule.shifted(3, shift).sigmas)
        sigmas = solver.schedule.sigmas.double().cpu()
        velocities = [v.double() for _, v, _, _ in steps]
        start, final = steps[0][2].double(), steps[-1][3].double()
        reference = comfy_res_multistep(lambda y, i, v=velocities, s=sigmas: y + s[i] * v[i], start, sigmas)
        ulps = 4 * torch.finfo(torch.float32).eps * reference.abs().max()
        assert (final - reference).abs().max() <= ulps
        assert [i for i, *_ in steps] == [0, 1, 2]


def test_tiny_pipeline_runs_res_multistep_end_to_end(tiny_pipeline, monkeypatch):
    pipeline, defaults = tiny_pipeline
    plan = validate(GenerationRequest(**BASE, steps=3, sample_solver=" RES_Multistep "), defaults)
    assert plan.sample_solver == "res_multistep"
    res = pipeline.generate(plan)
    assert res.video.shape == (107, 32, 32, 3) and res.audio.shape[0] == 2
    assert torch.isfinite(res.video).all() and torch.isfinite(res.audio).all() and res.video.std() > 1e-3
    euler = latents(pipeline, monkeypatch, defaults, steps=3)
    assert not torch.equal(res.video_latents, euler[0])  # 3 forwards: one second-order step
    assert not torch.equal(res.audio_latents, euler[1])


@pytest.mark.parametrize("steps", [1, 2])
def test_tiny_pipeline_up_to_two_forwards_is_euler_bit_for_bit(tiny_pipeline, monkeypatch, steps):
    pipeline, defaults = tiny_pipeline
    euler = latents(pipeline, monkeypatch, defaults, steps=steps)
    res = latents(pipeline, monkeypatch, defaults, steps=steps, sample_solver="res_multistep")
    assert torch.equal(euler[0], res[0]) and torch.equal(euler[1], res[1])


def test_default_is_euler_and_the_same_as_naming_it(tiny_pipeline, monkeypatch):
    pipeline, defaults = tiny_pipeline
    plan = validate(GenerationRequest(**BASE, steps=3), defaults)
    assert plan.sample_solver == "euler"
    default = latents(pipeline, monkeypatch, defaults, steps=3)
    named = latents(pipeline, monkeypatch, defaults, steps=3, sample_solver="Euler")
    assert torch.equal(default[0], named[0]) and torch.equal(default[1], named[1])


def test_an_edit_composes_kept_cells_stay_the_source(tiny_pipeline, monkeypatch):
    """Latent-mask editing steps towards the restored clean estimate: with RES the history is that estimate, and
    the last step (to sigma 0) returns it, so kept cells are the source's bit for bit."""
    pipeline, defaults = tiny_pipeline
    rng = np.random.default_rng(0)
    frames = rng.integers(0, 255, (107, 32, 32, 3), dtype=np.uint8)
    grid = np.ones((32, 2, 2))
    grid[:16] = 0
    source = MediaRef(Path("/src.mp4"), "src.mp4", "video")
    kw = {"steps": 3, "source_video": source, "video_noise_mask": grid.tolist()}
    video, _ = latents(pipeline, monkeypatch, defaults, Conditioning(edit_video=frames), sample_solver="res_multistep",
                       **kw)
    euler, _ = latents(pipeline, monkeypatch, defaults, Conditioning(edit_video=frames), **kw)
    clean = encode_visual_condition(pipeline.components.vae, torch.from_numpy(frames).permute(3, 0, 1, 2)[None])
    assert torch.equal(video[:, :, :16], clean[:, :, :16])
    assert not torch.equal(video[:, :, 16:], euler[:, :, 16:])


def test_continuation_windows_each_start_their_own_solver_state(tiny_pipeline, monkeypatch):
    """Each window is its own diffusion: two fresh solvers (video, audio) per window, none shared across."""
    pipeline, defaults = tiny_pipeline
    recorder = Recorder(monkeypatch)
    plan = validate(GenerationRequest(prompt="a beach", width=32, height=32, steps=3, seed=7, duration_s=10,
                                      long_video=True, long_video_mode="continuation",
                                      continuation_window_frames=124, sample_solver="res_multistep"), defaults)
    monkeypatch.setattr(pipeline.decoder, "decode", lambda video, audio, clock, cache, *sink: (video, audio))
    video, audio = pipeline.generate(plan)
    windows = len(plan.windows)
    assert windows >= 2 and len(recorder.solvers) == 2 * windows
    assert all(s.name == "res_multistep" and [i for i, *_ in steps] == [0, 1, 2] for s, steps in recorder.solvers)
    assert torch.isfinite(video).all() and torch.isfinite(audio).all()

