"""Ref2VA with a video reference, through our own code end to end (the reference cannot run video
references here without torchvision): row counts, positions, timesteps and labels against the spec's formulas."""

from __future__ import annotations

import subprocess

import numpy as np
import pytest
import torch
from PIL import Image

from h3serve.engine.planning import plan_request
from h3serve.model.layout import Role
from h3serve.rank.media_conditioning import load_conditioning
from h3serve.rules.request import GenerationRequest, MediaRef


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    d = tmp_path_factory.mktemp("media")
    video = d / "clip.mp4"
    subprocess.run(
        ["ffmpeg", "-v", "error", "-f", "lavfi", "-i", "testsrc2=size=256x256:rate=30", "-f", "lavfi",
         "-i", "sine=frequency=330:sample_rate=44100", "-t", "3", "-c:v", "libx264", "-pix_fmt", "yuv420p",
         "-c:a", "aac", "-shortest", str(video)],
        check=True,
    )  # fmt: skip
    image = d / "still.png"
    y, x = np.mgrid[0:384, 0:256]
    Image.fromarray(np.stack([x % 256, y % 256, (x + y) % 256], -1).astype(np.uint8)).save(image)
    return [MediaRef(image, "still.png"), MediaRef(video, "clip.mp4")]


@pytest.fixture(scope="module")
def encoded(tiny_pipeline, media):
    pipeline, defaults = tiny_pipeline
    plan = plan_request(GenerationRequest(prompt="make it dance", references=tuple(media), steps=1), defaults)
    cond = load_conditioning(plan, defaults)
    return plan, cond, pipeline.encode(plan, cond), pipeline


def test_video_reference_is_normalised(encoded):
    _, cond, _, _ = encoded
    image, video = cond.references
    assert image.image.size == (64, 96)  # short edge 64 (the checkpoint's), 256x384 -> 64x96
    assert video.frames.shape == (72, 64, 64, 3)  # 3 s at 30 fps -> 72 frames at 24 fps, own 1:1 canvas
    # 3 s (+ AAC priming/padding, < 2 frames) resampled 44.1 -> 32 kHz, mono duplicated to stereo
    assert video.audio.shape[0] == 2 and 96_000 <= video.audio.shape[1] < 96_000 + 2 * 1024
    assert torch.equal(video.audio[0], video.audio[1])


def test_presentation_labels(encoded):
    _, _, enc, pipeline = encoded
    text = pipeline.components.text.tokenizer.decode(enc.token_ids)
    # The soundtrack's label comes before its video's; frame pairs are stamped with their mean time (.1f).
    assert text.index("<Picture 1>: ") < text.index("<Audio 1>: ") < text.index("<Video 1>: ")
    stamps = [s for s in ("<0.2 seconds>", "<1.2 seconds>", "<2.2 seconds>") if s in text]
    assert stamps == ["<0.2 seconds>", "<1.2 seconds>", "<2.2 seconds>"]  # 6 frames at 2 fps -> 3 pairs
    assert text.count("<|video_pad|>") > 0 and text.endswith("make it dance")


def test_rows_positions_and_timesteps(encoded):
    plan, cond, enc, _ = encoded
    layout, L = enc.layout, len(enc.token_ids)
    pos = layout.packed.position_ids
    # Image: 64x96 -> latent 6x4 -> 3x2 patches, one frame at the clock's first slot.
    image_rows = 6
    # Video: 72 frames snapped down to 56 = 17·3 + 5 -> 17 latent frames of 4x4 latents (2x2 patches).
    video_rows = 17 * 4
    # Soundtrack: N samples -> ceil(N / 800) latents per channel (120 or 121 here), packed before the video.
    la = -(-cond.references[1].audio.shape[1] // 800)
    assert la in (120, 121)
    sound_rows = 2 * la
    assert layout.num_video_condition_rows == image_rows + video_rows
    assert layout.num_audio_reference_rows == sound_rows
    assert [z.shape[2:] for z in enc.visual] == [(1, 6, 4), (17, 4, 4)]

    roles = layout.roles
    assert torch.all(pos[L : L + image_rows, 0] == L)  # image at t = clock, then clock += 1
    sound = pos[roles == Role.AUDIO_REFERENCE]
    assert sound[0, 0] == L + 1 and sound[la - 1, 0] == L + la and sound[la, 0] == L + 1
    assert set(sound[:la, 2].tolist()) == {0.0} and set(sound[la:, 2].tolist()) == {16.0}  # its video's width axis
    video = pos[L + image_rows + sound_rows : L + image_rows + sound_rows + video_rows]
    assert video[0, 0] == L + 1 and video[4, 0] == pytest.approx(L + 1 + 5 / 3)  # frame 1 is 5/3 later
    # Clock after the video: max(soundtrack latents, 17-frame span 93.33) = la -> targets at L + 1 + la.
    assert pos[roles == Role.VIDEO][0, 0] == L + 1 + la and pos[roles == Role.AUDIO][0, 0] == L + 1 + la
    assert (roles == Role.VIDEO).sum() == plan.latent_frames * 2 * 4
    t, idx = layout.row_timesteps(0.0, 0.0)
    assert t.tolist() == pytest.approx([0.0, 0.999, 1.0])
    assert torch.all(t[idx][roles == Role.VIDEO_CONDITION] == torch.tensor(0.999))


def test_video_reference_generates(encoded):
    plan, cond, _, pipeline = encoded
    out = pipeline.generate(plan, cond)
    assert out.video.shape == (plan.num_frames, plan.height, plan.width, 3)
    assert torch.isfinite(out.video).all() and torch.isfinite(out.audio).all()
