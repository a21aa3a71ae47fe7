"""Latent-mask editing on the tiny checkpoint (32x32, 4 s: a (32, 2, 2) latent grid, 178 audio latents)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from h3serve.model.conditioning import encode_audio_condition, encode_visual_condition
from h3serve.model.pipeline_types import Conditioning
from h3serve.rules.request import GenerationRequest, MediaRef
from h3serve.rules.validate import validate

SRC_V, SRC_A = MediaRef(Path("/src.mp4"), "src.mp4", "video"), MediaRef(Path("/src.wav"), "src.wav", "audio")
BASE = {"prompt": "a red ball", "width": 32, "height": 32, "duration_s": 4, "steps": 2, "seed": 3}


@pytest.fixture(scope="module")
def source():
    rng = np.random.default_rng(0)
    frames = rng.integers(0, 255, (107, 32, 32, 3), dtype=np.uint8)
    audio = torch.from_numpy(rng.uniform(-0.5, 0.5, (2, 32_000 * 4)).astype(np.float32))
    return Conditioning(edit_video=frames, edit_audio=audio)


def latents(pipeline, monkeypatch, defaults, cond=None, **kw):
    """(video, audio) latents of one request, without the decode."""
    monkeypatch.setattr(pipeline.decoder, "decode", lambda video, audio, clock, cache, *sink: (video, audio))
    return pipeline.generate(validate(GenerationRequest(**BASE, **kw), defaults), cond)


def clean_video(pipeline, frames):
    return encode_visual_condition(pipeline.components.vae, torch.from_numpy(frames).permute(3, 0, 1, 2)[None])


def test_all_zero_mask_returns_the_source_latents_and_its_vae_round_trip(tiny_pipeline, source):
    pipeline, defaults = tiny_pipeline
    plan = validate(GenerationRequest(**BASE, source_video=SRC_V, video_noise_mask=0), defaults)
    result = pipeline.generate(plan, source)
    clean = clean_video(pipeline, source.edit_video)
    assert torch.equal(result.video_latents, clean)
    assert torch.equal(result.video, pipeline.decoder.decode_video(clean).cpu())


def test_all_one_mask_is_plain_generation(tiny_pipeline, source, monkeypatch):
    pipeline, defaults = tiny_pipeline
    plain = latents(pipeline, monkeypatch, defaults)
    edited = latents(pipeline, monkeypatch, defaults, source, source_video=SRC_V, video_noise_mask=[1.0] * 32)
    assert torch.equal(plain[0], edited[0]) and torch.equal(plain[1], edited[1])


def test_half_mask_keeps_exactly_the_kept_cells(tiny_pipeline, source, monkeypatch):
    pipeline, defaults = tiny_pipeline
    grid = np.ones((32, 2, 2))
    grid[:16] = 0  # the first half of the latent frames is kept ...
    grid[16:, :, 0] = 0  # ... and the left cell column of the rest (inside generated tokens: per cell, not token)
    video, _ = latents(pipeline, monkeypatch, defaults, source, source_video=SRC_V, video_noise_mask=grid.tolist())
    clean = clean_video(pipeline, source.edit_video)
    kept = torch.from_numpy(grid == 0)[None, None].expand_as(clean)
    assert torch.equal(video[kept], clean[kept])
    changed = (video != clean)[~kept]
    assert changed.float().mean() > 0.99  # every generated cell moved off the source
    plain = latents(pipeline, monkeypatch, defaults)
    assert not torch.equal(video[~kept], plain[0][~kept])  # the kept cells condition the generated ones


def test_audio_mask_and_lock_source_keep_the_source_audio_latents(tiny_pipeline, source, monkeypatch):
    pipeline, defaults = tiny_pipeline
    rows = encode_audio_condition(pipeline.components.audio_vae, source.edit_audio)
    clean = rows.reshape(2, -1, rows.shape[-1]).permute(0, 2, 1)  # [2, 32, 160]: 4 s of a 4.46 s target (178)
    cond = Conditioning(edit_audio=source.edit_audio)
    _, locked = latents(pipeline, monkeypatch, defaults, cond, audio_mode="lock_source", source_audio=SRC_A)
    assert torch.equal(locked[:, :, :160], clean) and not locked[:, :, 160:].any()  # held whole, silence after
    mask = [[0.0] * 89 + [1.0] * 89] * 2  # keep the first half of the soundtrack
    _, edited = latents(pipeline, monkeypatch, defaults, cond, source_audio=SRC_A, audio_noise_mask=mask)
    assert torch.equal(edited[:, :, :89], clean[:, :, :89]) and not torch.equal(edited[:, :, 89:], clean[:, :, 89:])


def test_a_short_source_audio_tail_is_generated(tiny_pipeline, source, monkeypatch):
    pipeline, defaults = tiny_pipeline
    cond = Conditioning(edit_audio=source.edit_audio[:, : 32_000 * 2])  # 2 s of a 4.46 s target: 80 latents
    _, audio = latents(pipeline, monkeypatch, defaults, cond, source_audio=SRC_A, audio_noise_mask=0)
    rows = encode_audio_condition(pipeline.components.audio_vae, cond.edit_audio)
    head = rows.reshape(2, -1, rows.shape[-1]).permute(0, 2, 1)
    assert torch.equal(audio[:, :, :80], head) and audio[:, :, 80:].abs().sum() > 0


def test_several_outputs_of_an_edit_are_each_its_single_edit(tiny_pipeline, source):
    """An edit's outputs run one after another (each its own anchor from its own noise): output i is the edit at
    seed + i, the kept cells the source's in each."""
    import dataclasses

    pipeline, defaults = tiny_pipeline
    grid = np.ones((32, 2, 2))
    grid[:16] = 0
    request = GenerationRequest(**BASE, source_video=SRC_V, video_noise_mask=grid.tolist())
    several = pipeline.generate(validate(dataclasses.replace(request, num_outputs=2), defaults), source)
    for i, got in enumerate((several, *several.others)):
        want = pipeline.generate(validate(dataclasses.replace(request, seed=BASE["seed"] + i), defaults), source)
        assert torch.equal(got.video_latents, want.video_latents) and torch.equal(got.video, want.video)
    assert not torch.equal(several.video_latents, several.others[0].video_latents)
