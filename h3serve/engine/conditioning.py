"""Decoded media -> the pipeline's `Conditioning`: keyframes on the canvas, references normalised (spec §8.4)."""

from __future__ import annotations

import numpy as np
import torch

from h3serve import limits
from h3serve.media import intake
from h3serve.model.conditioning import (
    AudioReference,
    Reference,
    StreamingVideoNormalizer,
    normalize_image_reference,
    normalize_video_reference,
    prepare_keyframes,
)
from h3serve.model.pipeline import Conditioning
from h3serve.validate import GenerationPlan, ModelDefaults


def reference_audio_tensor(audio: intake.AudioMedia, max_seconds: float) -> torch.Tensor:
    """Truncate at the native rate, mono -> stereo, then resample once to 32 kHz: (2, N) float32."""
    samples = audio.samples[:, : int(max_seconds * audio.sample_rate)]
    if samples.shape[0] == 1:
        samples = np.repeat(samples, 2, axis=0)
    if audio.sample_rate != limits.AUDIO_SAMPLE_RATE:
        samples = intake.resample_audio(samples, audio.sample_rate, limits.AUDIO_SAMPLE_RATE)
    return torch.from_numpy(np.ascontiguousarray(samples, dtype=np.float32))


def load_conditioning(plan: GenerationPlan, defaults: ModelDefaults) -> Conditioning:
    """Decode the plan's media files and normalise them for its task."""
    if plan.task == "fl2va":
        fields = [("image", plan.image), ("last_image", plan.last_image)]
        images = [intake.load_image(ref, field).image for field, ref in fields if ref is not None]
        return Conditioning(keyframes=prepare_keyframes(images, plan.width, plan.height), anchors=plan.anchors)
    if plan.task != "ref2va":
        return Conditioning()

    def reduce(fps: float, width: int, height: int) -> StreamingVideoNormalizer:
        return StreamingVideoNormalizer(
            fps, width, height, plan.num_frames, defaults.canvas_short_edge, defaults.canvas_max_pixels
        )

    refs: list[Reference] = []
    for media in intake.load_references(plan.references, reduce_video=reduce):
        if isinstance(media, intake.ImageMedia):
            refs.append(normalize_image_reference(media.image, defaults.reference_image_short_edge))
        elif isinstance(media, intake.VideoMedia):
            audio = None if media.audio is None else reference_audio_tensor(media.audio, plan.duration_s)
            refs.append(
                normalize_video_reference(
                    media.frames,
                    limits.FPS if media.reduced else media.fps,  # reduced: already at 24 fps and on the canvas
                    plan.num_frames,
                    defaults.canvas_short_edge,
                    defaults.canvas_max_pixels,
                    audio,
                )
            )
        else:
            refs.append(AudioReference(reference_audio_tensor(media, plan.duration_s)))
    return Conditioning(references=refs)
