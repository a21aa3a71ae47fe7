"""The request the multi-rank tests run, torch-free (a node process of the two-namespace test plans it too)."""

from __future__ import annotations

import wave
from pathlib import Path

import numpy as np
from PIL import Image

from h3serve.engine.planning import plan_request
from h3serve.media.mp4 import EncoderOptions, write_mp4
from h3serve.rules.request import GenerationRequest, MediaRef, TimelineGuide
from h3serve.rules.validate import GenerationPlan, ModelDefaults, validate

# 17 byte-level tokens: with 4 s at 128x64 the packed sequence is 17 + 2·178 audio + 256 video = 629 rows,
# which no degree used here (2, 3, 4) divides, so every layout runs with padded chunks.
PROMPT = "waves on a beach!"
STEPS, SEED, DURATION_S = 2, 1, 4


def plan_for(defaults: ModelDefaults, steps: int = STEPS) -> GenerationPlan:
    return validate(GenerationRequest(prompt=PROMPT, steps=steps, seed=SEED, duration_s=DURATION_S), defaults)


def guided_plan(folder: Path, defaults: ModelDefaults) -> GenerationPlan:
    """The request with timeline guides: an image at frame 37 (RoPE time T0 + 61 2/3), a 5-frame clip ending the
    video (2 latent frames) and half a second of sound from frame 12, their files written into `folder`."""
    image = folder / "guide.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (48, 80, 3), dtype=np.uint8)).save(image)
    clip = folder / "ending.mp4"
    frames = np.random.default_rng(1).random((5, 64, 96, 3), dtype=np.float32)
    write_mp4(clip, frames, np.zeros((2, 6_667), np.float32), options=EncoderOptions(preset="ultrafast"))
    sound = folder / "tone.wav"
    with wave.open(str(sound), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16_000)
        w.writeframes((8000 * np.sin(np.arange(8_000) * 0.17)).astype("<i2").tobytes())
    guides = (
        TimelineGuide(37, MediaRef(image, "guide.png", "image")),
        TimelineGuide(-5, MediaRef(clip, "ending.mp4", "video")),
        TimelineGuide(12, audio=MediaRef(sound, "tone.wav", "audio")),
    )
    request = GenerationRequest(prompt=PROMPT, steps=STEPS, seed=SEED, duration_s=DURATION_S, guides=guides)
    return plan_request(request, defaults)
