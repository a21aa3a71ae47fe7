"""End-to-end T2VA parity with the diffusers 0.42.1 reference pipeline on the tiny checkpoint (fp32).

h3serve's steps = N denoiser forwards is diffusers' num_inference_steps = N + 1 sigma points."""

from __future__ import annotations

import pytest
import torch
from diffusers import MiniMaxH3Scheduler

from h3serve.rules.request import GenerationRequest
from h3serve.rules.validate import validate
from h3serve.tools.bench.peer import diffusers_steps, run_reference

PROMPT = "A red fox trots through fresh snow at dawn."


@pytest.mark.parametrize("steps, seed", [(3, 0), (5, 7)])
def test_t2va_matches_diffusers(tiny_checkpoint, tiny_pipeline, steps, seed):
    pipeline, defaults = tiny_pipeline
    plan = validate(GenerationRequest(prompt=PROMPT, duration_s=5, steps=steps, seed=seed), defaults)
    assert plan.num_frames == 124 and diffusers_steps(steps) == steps + 1
    # The schedules are the reference scheduler's at N + 1 points, bit for bit, with N forwards.
    for ours_sched, shift in zip(pipeline.sampler.schedules(plan), (defaults.flow_shift, defaults.audio_flow_shift),
                                 strict=True):
        ref_sched = MiniMaxH3Scheduler(shift=shift)
        ref_sched.set_timesteps(steps + 1)
        assert torch.equal(ours_sched.sigmas, ref_sched.sigmas) and len(ours_sched) == steps
    progress: list[tuple[int, int]] = []
    ours = pipeline.generate(plan, on_step=lambda done, total: progress.append((done, total)))
    assert progress == [(i, steps) for i in range(1, steps + 1)]  # the progress total is N forwards
    ref = run_reference(tiny_checkpoint, PROMPT, plan.num_frames, steps, seed)  # diffusers at steps + 1

    ref_video = torch.from_numpy(ref.get("videos")[0])  # [T, H, W, 3]
    ref_audio = ref.get("audio")[0]  # [2, N]
    assert ours.video_latents.shape == ref.get("latents").shape
    # Same schedule, same kernels on the CPU in fp32: the latents are the reference's bit for bit.
    assert torch.equal(ours.video_latents, ref.get("latents"))
    assert torch.equal(ours.audio_latents, ref.get("audio_latents"))
    assert (ours.video_latents - ref.get("latents")).abs().max() <= 1e-5
    assert (ours.audio_latents - ref.get("audio_latents")).abs().max() <= 1e-5
    assert ours.video.shape == ref_video.shape == (124, plan.height, plan.width, 3)
    assert (ours.video - ref_video).abs().max() <= 1e-5
    assert ours.audio.shape == ref_audio.shape == (2, 165_600)
    assert (ours.audio - ref_audio).abs().max() <= 1e-5
    # The comparison is not vacuous: the outputs carry signal and differ between seeds.
    assert ours.video.std() > 1e-3 and ours.audio.abs().max() > 1e-4
