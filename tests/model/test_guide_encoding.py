"""Timeline guides through the pipeline's first stage on the tiny checkpoint, composed with FL2VA keyframes and Ref2VA
references in the documented order [text | guides | keyframes or references | targets]: guides never reach the text
encoder (the presentation and its <Picture N> labels are those of the request without them), their latents come
first, and an image guide is the condition recipe's own latents of its picture on the canvas. (The text encoder is
replaced by a recorder of what it is asked to read: what it would make of it is not at stake here.)"""

from __future__ import annotations

import dataclasses
import wave

import numpy as np
import pytest
import torch
from PIL import Image, ImageOps

from h3serve.engine.planning import plan_request
from h3serve.model.conditioning import encode_visual_condition, image_pixels
from h3serve.model.layout import Role
from h3serve.rank.media_conditioning import load_conditioning
from h3serve.rules.request import GenerationRequest, MediaRef, TimelineGuide


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    folder = tmp_path_factory.mktemp("guide-media")
    rng = np.random.default_rng(0)
    refs = {}
    for name, size in (("key", (512, 256)), ("guide", (96, 64)), ("ref", (256, 256))):
        Image.fromarray(rng.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)).save(folder / f"{name}.png")
        refs[name] = MediaRef(folder / f"{name}.png", f"{name}.png", "image")
    with wave.open(str(folder / "tone.wav"), "wb") as w:
        w.setnchannels(2)
        w.setsampwidth(2)
        w.setframerate(32_000)
        w.writeframes((6000 * np.sin(np.arange(2 * 48_000) * 0.05)).astype("<i2").tobytes())
    refs["sound"] = MediaRef(folder / "tone.wav", "tone.wav", "audio")
    return refs


@pytest.fixture
def read_by_text_encoder(tiny_pipeline, monkeypatch) -> list:
    """What the text encoder is given: (token ids, vision inputs' keys) per call; it answers zeros."""
    pipeline, _ = tiny_pipeline
    calls = []

    def encode(ids, vision=None, key=None):
        calls.append((list(ids), sorted(vision or {})))
        return torch.zeros(1, len(ids), 32)

    monkeypatch.setattr(pipeline.components.text, "encode", encode)
    return calls


def _encoded(tiny_pipeline, request: GenerationRequest):
    pipeline, defaults = tiny_pipeline
    plan = plan_request(request, defaults)
    return plan, pipeline.encode(plan, load_conditioning(plan, defaults))


def test_fl2va_keyframes_follow_the_guides_and_the_text_is_unchanged(tiny_pipeline, media, read_by_text_encoder):
    guides = (TimelineGuide(40, media["guide"], media["sound"]),)
    request = GenerationRequest(prompt="a fox", duration_s=4, seed=3, image=media["key"], guides=guides)
    plan, guided = _encoded(tiny_pipeline, request)
    _, plain = _encoded(tiny_pipeline, dataclasses.replace(request, guides=()))
    assert plan.task == "fl2va" and guided.token_ids == plain.token_ids  # guides never enter Qwen
    assert read_by_text_encoder[0] == read_by_text_encoder[1]  # nor its vision inputs (one keyframe's)
    assert guided.guide_visuals == 1 and len(guided.visual) == 2
    assert torch.equal(guided.visual[1], plain.visual[0])  # the keyframe's latents, after the guide's
    per_frame = (plan.latent_height // 2) * (plan.latent_width // 2)
    roles = guided.layout.roles
    text = len(guided.token_ids)
    room = (3 * plan.audio_latents - 5 * 40) // 3  # 111 latents from frame 40 to the end
    audio = min(room, 60)  # 1.5 s of sound: 60 latents, all kept
    assert audio == 60 and guided.layout.num_audio_reference_rows == 2 * audio
    assert guided.audio_rows[0].shape == (2 * audio, 32)
    picture, sound = [Role.VIDEO_CONDITION] * per_frame, [Role.AUDIO_REFERENCE] * 2 * audio
    expected = picture + sound + picture  # the guide's picture, its sound, then the keyframe
    assert roles[text : text + len(expected)].tolist() == [int(r) for r in expected]
    times = guided.layout.packed.position_ids[:, 0]
    assert times[text] == text + 200 / 3 and times[text + per_frame + 2 * audio] == text  # guide, then the keyframe
    # the guide's latents: its picture center-cropped onto the canvas, through the condition recipe
    pipeline, _ = tiny_pipeline
    image = Image.open(media["guide"].path).convert("RGB")
    fitted = ImageOps.fit(image, (plan.width, plan.height), Image.Resampling.LANCZOS)
    assert torch.equal(guided.visual[0], encode_visual_condition(pipeline.components.vae, image_pixels(fitted)))


def test_ref2va_references_follow_the_guides_on_the_clock_after_them(tiny_pipeline, media, read_by_text_encoder):
    request = GenerationRequest(prompt="a fox", duration_s=4, seed=3, references=(media["ref"],),
                                guides=(TimelineGuide(-1, media["guide"]),))
    plan, guided = _encoded(tiny_pipeline, request)
    _, plain = _encoded(tiny_pipeline, dataclasses.replace(request, guides=()))
    assert plan.task == "ref2va" and guided.token_ids == plain.token_ids
    assert read_by_text_encoder[0] == read_by_text_encoder[1]
    assert guided.guide_visuals == 1 and torch.equal(guided.visual[1], plain.visual[0])
    text = len(guided.token_ids)
    per_frame = (plan.latent_height // 2) * (plan.latent_width // 2)
    t0 = text + 1  # one reference image: one clock unit
    assert guided.layout.packed.position_ids[text, 0] == t0 + 5 * 106 / 3  # the last frame's time
    assert torch.equal(guided.layout.packed.position_ids[text + per_frame :], plain.layout.packed.position_ids[text:])
