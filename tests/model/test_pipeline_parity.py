"""End-to-end T2VA parity with the diffusers 0.42.1 reference pipeline on the tiny checkpoint (fp32)."""

from __future__ import annotations

import pytest
import torch

from h3serve.request import GenerationRequest
from h3serve.tools.bench.peer import run_reference
from h3serve.validate import validate

PROMPT = "A red fox trots through fresh snow at dawn."


@pytest.mark.parametrize("steps, seed", [(4, 0), (6, 7)])
def test_t2va_matches_diffusers(tiny_checkpoint, tiny_pipeline, steps, seed):
    pipeline, defaults = tiny_pipeline
    plan = validate(GenerationRequest(prompt=PROMPT, duration_s=5, steps=steps, seed=seed), defaults)
    assert plan.num_frames == 124
    ours = pipeline.generate(plan)
    ref = run_reference(tiny_checkpoint, PROMPT, plan.num_frames, steps, seed)

    ref_video = torch.from_numpy(ref.get("videos")[0])  # [T, H, W, 3]
    ref_audio = ref.get("audio")[0]  # [2, N]
    assert ours.video_latents.shape == ref.get("latents").shape
    assert (ours.video_latents - ref.get("latents")).abs().max() <= 1e-5
    assert (ours.audio_latents - ref.get("audio_latents")).abs().max() <= 1e-5
    assert ours.video.shape == ref_video.shape == (124, plan.height, plan.width, 3)
    assert (ours.video - ref_video).abs().max() <= 1e-5
    assert ours.audio.shape == ref_audio.shape == (2, 165_600)
    assert (ours.audio - ref_audio).abs().max() <= 1e-5
    # The comparison is not vacuous: the outputs carry signal and differ between seeds.
    assert ours.video.std() > 1e-3 and ours.audio.abs().max() > 1e-4
