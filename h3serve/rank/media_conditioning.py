"""Decoded media -> the pipeline's `Conditioning`: keyframes on the canvas, references normalised (spec §8.4)."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from h3serve.media import media_inputs as intake
from h3serve.media.control_media import control_field, control_frames
from h3serve.media.source import load_source_audio, load_source_video
from h3serve.model.conditioning import (
    AudioReference,
    Reference,
    StreamingVideoNormalizer,
    normalize_image_reference,
    normalize_video_reference,
    prepare_keyframes,
)
from h3serve.model.pipeline_types import Conditioning, ControlPixels
from h3serve.rules import limits
from h3serve.rules.request import MediaRef
from h3serve.rules.validate import GenerationPlan, ModelDefaults


def reference_audio_tensor(audio: intake.AudioMedia, max_seconds: float) -> torch.Tensor:
    """Truncate at the native rate, mono -> stereo, then resample once to 32 kHz: (2, N) float32."""
    samples = audio.samples[:, : int(max_seconds * audio.sample_rate)]
    if samples.shape[0] == 1:
        samples = np.repeat(samples, 2, axis=0)
    if audio.sample_rate != limits.AUDIO_SAMPLE_RATE:
        samples = intake.resample_audio(samples, audio.sample_rate, limits.AUDIO_SAMPLE_RATE)
    return torch.from_numpy(np.ascontiguousarray(samples, dtype=np.float32))


def load_edit_sources(plan: GenerationPlan) -> tuple[np.ndarray | None, torch.Tensor | None]:
    """Latent-mask editing / lock_source: the source frames on the canvas, and the audio its audio mask keeps
    (source_audio, else the source video's soundtrack)."""
    if not plan.edit:
        return None, None
    frames, soundtrack = None, None
    want_soundtrack = plan.audio_mask is not None and plan.source_audio is None
    if plan.source_video is not None and (plan.video_mask is not None or want_soundtrack):
        frames, soundtrack = load_source_video(
            plan.source_video, "source_video", plan.num_frames, plan.width, plan.height, want_soundtrack
        )
        if want_soundtrack and soundtrack is None:
            raise intake.MediaFormatError(
                plan.source_video.name, "source_video", "source_video has no audio track for audio editing",
                "a video with a soundtrack, or a source_audio upload",
            )
    if plan.source_audio is not None and plan.audio_mask is not None:
        soundtrack = load_source_audio(plan.source_audio, "source_audio", plan.duration_s)
    return frames, None if soundtrack is None else torch.from_numpy(soundtrack)


def control_pixels(plan: GenerationPlan) -> ControlPixels | None:
    """A ControlNet request's media as the branch reads them: decoded onto the 24 fps grid, /255, resized
    bilinearly (align_corners False) to the canvas; a mask thresholded at 0.5 before and after the resize, a still
    mask held for every frame. Each frame goes onto the canvas as it is decoded (interpolation is per frame, so
    this equals resizing the stacked clip): only the frame being decoded is ever at the source's size."""
    control = plan.control
    if control is None:
        return None
    size = (plan.height, plan.width)

    def on_canvas(pixels: np.ndarray, mask: bool) -> torch.Tensor:
        frame = torch.from_numpy(pixels).permute(2, 0, 1)[None].float().div_(255)  # [1, C, h, w]
        if mask:
            frame = (frame > 0.5).float()
        if frame.shape[-2:] != size:
            frame = F.interpolate(frame, size=size, mode="bilinear", align_corners=False)
        if mask:
            frame = (frame > 0.5).float()
        return frame[0]  # [C, H, W]

    def fit(ref: MediaRef | None, part: str) -> torch.Tensor | None:
        if ref is None:
            return None
        field, mask = control_field(control, part), part == "mask"
        out: torch.Tensor | None = None  # [1, C, T, H, W]
        filled = 0
        for item in control_frames(ref, field, plan.num_frames, gray=mask):
            frame = on_canvas(item.pixels, mask)
            if item.still:  # one frame for every output frame
                return frame[None, :, None].expand(-1, -1, plan.num_frames, -1, -1)
            if out is None:
                out = torch.empty((1, frame.shape[0], plan.num_frames, *size))
            out[0, :, item.start : item.end] = frame[:, None]
            filled = item.end
        if out is None or filled == 0:
            raise intake.MediaDecodeError(ref.name, field, "the file has no decodable video frames",
                                          "a complete, valid file")
        out[:, :, filled:] = out[:, :, filled - 1 : filled]  # a shorter video holds its last frame
        return out

    return ControlPixels(
        scale=1.0 if control.scale is None else control.scale,
        control=fit(control.control, "control"),
        source=fit(control.source, "source"),
        mask=fit(control.mask, "mask"),
    )


def load_conditioning(plan: GenerationPlan, defaults: ModelDefaults) -> Conditioning:
    """Decode the plan's media files and normalise them for its task (and its edit sources, its control)."""
    cond = _load_task_conditioning(plan, defaults)
    cond.control = control_pixels(plan)
    cond.edit_video, cond.edit_audio = load_edit_sources(plan)
    if plan.extend_video is not None:  # window 0 of the extension: the source on the canvas, and its soundtrack
        frames, audio = load_source_video(
            plan.extend_video, "extend_video", plan.windows[0].end, plan.width, plan.height, with_audio=True
        )
        cond.extend_video, cond.extend_audio = frames, None if audio is None else torch.from_numpy(audio)
    return cond


def _load_task_conditioning(plan: GenerationPlan, defaults: ModelDefaults) -> Conditioning:
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
    for media in intake.load_references(plan.references, reduce_video=reduce, start_times=plan.start_times):
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
