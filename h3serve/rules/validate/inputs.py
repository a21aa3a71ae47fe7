"""The rules of a request's inputs: its task (from the media it sends), Ref2VA reference trims, lock_source's
driving audio, an extension's source and latent-mask edits."""

from __future__ import annotations

import dataclasses
import math

from h3serve.errors import RequestError
from h3serve.rules import geometry, limits
from h3serve.rules.edit_mask import LatentMask, MaskError, audio_mask, video_mask
from h3serve.rules.names import AUDIO_MODES, TASKS
from h3serve.rules.request import GenerationRequest
from h3serve.rules.shown import shown


def resolve_task(request: GenerationRequest) -> str:
    """references -> ref2va, keyframes -> fl2va, else t2va; an explicit task must agree with the inputs."""
    has_keyframes = request.image is not None or request.last_image is not None
    continuation = request.long_video is True and request.long_video_mode == "continuation"
    if continuation and request.task is None and not has_keyframes:
        return "ref2va"  # continuation runs on the Ref2VA path; its windows' latent guides are its references
    if has_keyframes and request.references:
        raise RequestError("references", "keyframes (image / last_image) and references cannot be combined")
    inferred = "ref2va" if request.references else "fl2va" if has_keyframes else "t2va"
    task = request.task
    if task is None:
        return inferred
    if task not in TASKS:
        raise RequestError("task", f"must be one of {', '.join(TASKS)}, got {shown(task)}")
    if task != inferred and inferred != "t2va":
        what = "references" if request.references else "keyframes"
        raise RequestError("task", f"{task} does not take {what}; this request is {inferred}")
    if task == "ref2va" and not request.references and not continuation:
        raise RequestError("task", "ref2va needs at least one reference (image, video or audio)")
    if task == "fl2va" and not has_keyframes:
        raise RequestError("task", "fl2va needs a first and/or last keyframe image")
    return task


def resolve_start_times(request: GenerationRequest, task: str) -> tuple[float, ...]:
    """`start_time_seconds` as a tuple of finite seconds >= 0; only for Ref2VA (it trims reference videos, not
    an edit's source_video). Whether the count matches the video references is the media intake's check."""
    value = request.start_time_seconds
    if value is None:
        return ()
    if task != "ref2va":
        raise RequestError("start_time_seconds", f"trims Ref2VA reference videos; this request is {task}")
    values = value if isinstance(value, tuple | list) else (value,)
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v < 0:
            raise RequestError("start_time_seconds", f"must be seconds >= 0 (one, or one per video), got {shown(v)}")
    if not values:
        raise RequestError("start_time_seconds", "must not be an empty list")
    return tuple(float(v) for v in values)


def driving_audio_split(request: GenerationRequest) -> GenerationRequest:
    """audio_mode=lock_source: the one driving audio as `source_audio` (an audio reference is taken out of the
    references, so it does not make the request Ref2VA). Other requests are returned as they are."""
    if request.audio_mode not in (None, *AUDIO_MODES):
        raise RequestError("audio_mode", f"must be native or lock_source, got {shown(request.audio_mode)}")
    if request.audio_mode != "lock_source":
        return request
    audio_refs = [r for r in request.references if r.kind == "audio"]
    if len(audio_refs) + (request.source_audio is not None) != 1:
        raise RequestError(
            "audio_mode", "lock_source requires exactly one driving audio (source_audio, or one audio reference)"
        )
    if request.source_audio is not None:
        return request
    rest = tuple(r for r in request.references if r.kind != "audio")
    return dataclasses.replace(request, references=rest, source_audio=audio_refs[0])


def resolve_extension(request: GenerationRequest, mode: str | None, extend_frames: int | None) -> int:
    """An extension's source length in frames, snapped down to 17n + 5 (0 without an extension)."""
    if request.extend_video is None:
        return 0
    if mode != "continuation":
        raise RequestError("extend_video", "an extension is a continuation (long_video_mode=continuation)")
    if extend_frames is None:
        raise RequestError("extend_video", "the source video's length was not measured")
    block, rest = limits.VAE_FRAMES_PER_CHUNK, limits.VAE_LATENTS_PER_CHUNK
    overlap = request.continuation_overlap_frames or limits.DEFAULT_OVERLAP_FRAMES
    frames = (extend_frames - rest) // block * block + rest if extend_frames >= rest else 0
    if frames <= overlap:
        raise RequestError(
            "extend_video",
            f"is {extend_frames} frames at {limits.FPS} fps; an extension needs more than the "
            f"overlap ({overlap} frames)",
        )
    return frames


def resolve_edit(
    request: GenerationRequest, mode: str | None, num_frames: int, height: int, width: int
) -> tuple[LatentMask | None, LatentMask | None]:
    """The canonical (video, audio) masks; the rules between sources, masks, continuation and lock_source."""
    lock = request.audio_mode == "lock_source"
    has_video_mask, has_audio_mask = request.video_noise_mask is not None, request.audio_noise_mask is not None
    if not (has_video_mask or has_audio_mask):
        if request.source_video is not None:
            raise RequestError("source_video", "edit sources require video_noise_mask or audio_noise_mask")
        if request.source_audio is not None and not lock:
            raise RequestError("source_audio", "requires an audio_noise_mask (or audio_mode=lock_source)")
    if request.extend_video is not None and (has_video_mask or has_audio_mask):
        field = "video_noise_mask" if has_video_mask else "audio_noise_mask"
        raise RequestError(field, "an extension cannot be combined with latent-mask editing")
    if has_video_mask and request.source_video is None:
        raise RequestError("video_noise_mask", "requires source_video")
    if has_audio_mask and request.source_video is None and request.source_audio is None:
        raise RequestError("audio_noise_mask", "requires source_audio or source_video")
    if has_audio_mask and lock:
        raise RequestError(
            "audio_noise_mask", "audio_mode=lock_source cannot be combined with audio latent-mask editing"
        )
    lt = geometry.latent_frames(num_frames)
    lh, lw = geometry.latent_edge(height), geometry.latent_edge(width)
    at = geometry.audio_latents(num_frames)
    try:
        field = "video_noise_mask"
        video = video_mask(request.video_noise_mask, lt, lh, lw) if has_video_mask else None
        field = "audio_noise_mask"
        audio = audio_mask(request.audio_noise_mask, at) if has_audio_mask else None
    except MaskError as e:
        raise RequestError(field, str(e)) from None
    if lock:  # the driving audio is kept whole: an all-0 audio mask over its soundtrack
        audio = audio_mask(0.0, at)
    return video, audio
