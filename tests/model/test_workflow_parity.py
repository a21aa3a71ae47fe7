"""FL2VA and Ref2VA parity with the diffusers 0.42.1 reference on the tiny checkpoint (fp32, latents bit for bit).

h3serve runs STEPS denoiser forwards; diffusers counts sigma points, so it is called with STEPS + 1."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers.modular_pipelines.minimax_h3.references import MiniMaxH3AudioReference, MiniMaxH3ImageReference
from PIL import Image

from h3serve.media.media_inputs import AudioMedia
from h3serve.model.conditioning import AudioReference, normalize_image_reference, prepare_keyframes
from h3serve.model.pipeline_types import Conditioning
from h3serve.rank.media_conditioning import reference_audio_tensor
from h3serve.rules.request import GenerationRequest, MediaRef
from h3serve.rules.validate import validate
from h3serve.tools.bench.peer import load_reference_pipeline

PROMPT = "The scene comes alive."
STEPS, SEED = 2, 5  # 2 forwards: diffusers' num_inference_steps=3


def picture(w: int, h: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w]
    base = np.stack([x / w, y / h, (x + y) / (w + h)], axis=-1) * 200
    return Image.fromarray((base + rng.uniform(0, 55, (h, w, 3))).astype(np.uint8))


@pytest.fixture(scope="module")
def reference_pipe(tiny_checkpoint):
    return {w: load_reference_pipeline(tiny_checkpoint, w) for w in ("fl2va", "ref2va")}


def _compare(ours, state):
    # h3serve at STEPS forwards is diffusers at STEPS + 1 sigma points: the latents bit for bit.
    assert torch.equal(ours.video_latents, state.get("latents"))
    assert torch.equal(ours.audio_latents, state.get("audio_latents"))
    assert (ours.video - torch.from_numpy(state.get("videos")[0])).abs().max() <= 1e-5
    assert (ours.audio - state.get("audio")[0]).abs().max() <= 1e-5


def _ref(name):
    return MediaRef(path=f"/dev/null/{name}", name=name, kind="image")


@pytest.mark.parametrize(
    "first, last",
    [((96, 64), None), (None, (64, 96)), ((128, 64), (100, 100))],
    ids=["first-only", "last-only", "both-different-aspect"],
)
def test_fl2va_matches_diffusers(tiny_pipeline, reference_pipe, first, last):
    pipeline, defaults = tiny_pipeline
    image = picture(*first, seed=1) if first else None
    last_image = picture(*last, seed=2) if last else None
    keyframes = [k for k in (image, last_image) if k is not None]
    request = GenerationRequest(
        prompt=PROMPT,
        steps=STEPS,
        seed=SEED,
        image=_ref("a") if image else None,
        last_image=_ref("b") if last_image else None,
    )
    plan = validate(request, defaults, keyframe_size=keyframes[0].size)
    cond = Conditioning(keyframes=prepare_keyframes(keyframes, plan.width, plan.height), anchors=plan.anchors)
    progress: list[tuple[int, int]] = []
    ours = pipeline.generate(plan, cond, on_step=lambda done, total: progress.append((done, total)))
    assert progress[-1] == (STEPS, STEPS)
    state = reference_pipe["fl2va"](
        prompt=PROMPT,
        image=image,
        last_image=last_image,
        num_frames=plan.num_frames,
        num_inference_steps=STEPS + 1,
        generator=torch.Generator().manual_seed(SEED),
        output_type="np",
    )
    assert state.get("videos").shape[2:4] == (plan.height, plan.width)
    _compare(ours, state)


@pytest.mark.parametrize("with_audio", [False, True], ids=["images", "image+audio"])
def test_ref2va_matches_diffusers(tiny_pipeline, reference_pipe, with_audio):
    pipeline, defaults = tiny_pipeline
    images = [picture(80, 120, seed=3)] if with_audio else [picture(80, 120, seed=3), picture(150, 90, seed=4)]
    t = np.arange(int(2.5 * 32000)) / 32000
    wave = (0.3 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)[None]  # 2.5 s mono at 32 kHz
    plan = validate(GenerationRequest(prompt=PROMPT, steps=STEPS, seed=SEED, references=(_ref("r"),)), defaults)
    refs = [normalize_image_reference(img, defaults.reference_image_short_edge) for img in images]
    ref_objs = [MiniMaxH3ImageReference(image=img) for img in images]
    if with_audio:
        refs.append(AudioReference(reference_audio_tensor(AudioMedia("a.wav", wave, 32000), plan.duration_s)))
        ref_objs.append(MiniMaxH3AudioReference(audio=torch.from_numpy(wave), sample_rate=32000))
    progress: list[tuple[int, int]] = []
    ours = pipeline.generate(plan, Conditioning(references=refs), on_step=lambda d, t: progress.append((d, t)))
    assert progress[-1] == (STEPS, STEPS)
    state = reference_pipe["ref2va"](
        prompt=PROMPT,
        references=ref_objs,
        num_frames=plan.num_frames,
        num_inference_steps=STEPS + 1,
        generator=torch.Generator().manual_seed(SEED),
        output_type="np",
    )
    _compare(ours, state)
