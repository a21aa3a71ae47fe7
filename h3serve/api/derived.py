"""Jobs made from another video: OpenAI's remix, edits and extensions, mapped onto H3's request.

- remix `{id}` (JSON `{"prompt"}`), by the source's length (`remix_values`); size, seconds, steps come from the
  source unless given, and `remixed_from_video_id` is set:
  - up to 15 s (any kind: plain, FL2VA, Ref2VA, an edit, a short long-video or extension): Ref2VA with the
    completed job's MP4 as the video reference;
  - longer (long videos, continuations, extensions): the source's plan rerun with the new prompt and the MP4 as a
    latent-mask edit of the whole clip at `REMIX_NOISE` (video and audio; a `video_noise_mask` /
    `audio_noise_mask` in the body overrides it): a one-pass (`full`) source in one pass, a continuation or an
    extension as a continuation over its whole length with its window, overlap and seed (per-window seeds
    seed + i), each window editing its own frames of the source.
- edits (multipart, `video` a file or `{"id": ...}`): with a video/audio noise mask, latent-mask editing of the
  video (the `source_video`); without, a Ref2VA edit of the whole clip (the video as the reference).
- extensions (multipart, `seconds` required: the new part's length): a continuation that starts from the video,
  whose tail is VAE-encoded as the first latent guide; the result is the source followed by the new part.

The other create fields (num_inference_steps, seed, size, extra_params, ...) work as on POST /v1/videos.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from fastapi import Request
from starlette.concurrency import run_in_threadpool

from h3serve.api.context import ServerContext
from h3serve.api.create_job import check_model, ensure_capacity, queue_request
from h3serve.api.error_envelope import APIError, bad_request, not_found
from h3serve.api.intake.control import control_types_given
from h3serve.api.intake.generation_request import store_media, with_lora
from h3serve.api.intake.read import VIDEO_FIELD, MediaSource, read_create_request
from h3serve.api.intake.request_model import VideoCreateFields
from h3serve.jobstore.records import UNFINISHED, Job, new_job_id
from h3serve.media.previews import VARIANTS
from h3serve.rules import limits
from h3serve.rules.request import GenerationRequest, MediaRef
from h3serve.rules.validate import RequestError, resolve_long_video_mode, resolve_task

REMIX_NOISE = 0.85  # a long video's remix: the latent-mask level over the whole clip (1 = generate, 0 = keep)


def remix_of_long(given: GenerationRequest, source: Job) -> dict[str, Any]:
    """A remix of a source longer than 15 s: its plan (mode, length, windows, seed) with the MP4 as a whole-clip
    latent-mask edit at REMIX_NOISE; what the remix request gives wins."""
    original = source.request
    try:
        mode = resolve_long_video_mode(original, resolve_task(original))
    except RequestError:
        mode = None
    if original.extend_video is not None:
        mode = "continuation"
    # The shortest duration that snaps up to the source's frame count (300 s gives 7213 frames: 299.9 s does too).
    duration_s = (source.num_frames - limits.VAE_FRAMES_PER_CHUNK + 1) / limits.FPS
    out: dict[str, Any] = {"long_video": True, "long_video_mode": mode or "full",
                           "video_noise_mask": REMIX_NOISE, "audio_noise_mask": REMIX_NOISE}
    if given.duration_s is None and given.num_frames is None:
        out["duration_s"] = duration_s
    if original.seed is not None:
        out["seed"] = original.seed
    if out["long_video_mode"] == "continuation":
        for name in ("continuation_window_frames", "continuation_overlap_frames"):
            if getattr(original, name) is not None:
                out[name] = getattr(original, name)
    return {k: v if getattr(given, k) is None else getattr(given, k) for k, v in out.items()}


def completed_job(ctx: ServerContext, video_id: str, param: str = "video_id") -> Job:
    """A job whose MP4 can be used as a source: 404 if unknown or expired, 409 unfinished, 422 failed."""
    job = ctx.store.get(video_id)
    if job is None:
        raise not_found(video_id)
    if job.status in UNFINISHED:
        raise APIError(409, f"Video '{video_id}' is not completed yet (status {job.status}).", "video_not_ready",
                       param, headers={"x-should-retry": "false"})
    if job.status == "failed":
        raise APIError(422, f"Video '{video_id}' failed; it cannot be used as a source.", "video_failed", param)
    if job.expired:
        raise APIError(404, f"The files of video '{video_id}' expired and were deleted.", "video_expired", param)
    if ctx.manager.outputs.head(job.id, VARIANTS["video"].file_name) is None:
        raise APIError(404, f"The MP4 of video '{video_id}' is missing from the output store (removed outside the "
                            "server); it cannot be used as a source.", "file_not_found", param)
    return job


def _copy_output(ctx: ServerContext, source: Job, job_id: str) -> MediaRef:
    """The source job's MP4, copied from the output store into the new job's inputs (deleting the source cannot
    break the new job)."""
    folder = ctx.manager.files.inputs_dir(job_id)
    dest = folder / f"{source.id}.mp4"
    ctx.manager.outputs.download(source.id, VARIANTS["video"].file_name, dest)
    return MediaRef(path=dest, name=source.id, kind="video")


def _with_source_defaults(given: GenerationRequest, source: Job | None) -> GenerationRequest:
    """`given` with the size, seconds and steps of the source job where the request does not give them."""
    if source is None:
        return given
    out: dict[str, Any] = {}
    if all(getattr(given, name) is None for name in ("width", "height", "aspect_ratio", "short_edge")):
        out["width"], out["height"] = (int(v) for v in source.size.split("x"))
    if given.duration_s is None and given.num_frames is None:
        out["duration_s"] = source.duration_s if source.request.long_video else float(source.seconds)
        for name in ("long_video", "long_video_mode"):
            if getattr(given, name) is None and getattr(source.request, name) is not None:
                out[name] = getattr(source.request, name)
    if given.steps is None and source.request.steps is not None:
        out["steps"] = source.request.steps
    return dataclasses.replace(given, **out)


# What a route makes of the request's own fields, the source video and (given by id) its job: the request to
# queue and how validation errors name its video.
Aliases = dict[str, str]
Build = Callable[[GenerationRequest, MediaRef, Job | None], tuple[GenerationRequest, Aliases]]
# The job's `seconds` from the request model and the source job (None: the planned duration).
Label = Callable[[VideoCreateFields, Job | None], str | None]


async def _submit(
    request: Request,
    ctx: ServerContext,
    build: Build,
    seconds_label: Label,
    video_id: str | None = None,
    takes_video: bool = True,
) -> Job:
    """Parse the body, resolve the source video (uploaded, or a completed job's), build the request, queue it."""
    try:
        await ensure_capacity(ctx)
        create = await read_create_request(request, ctx.config.max_body_bytes, take_video=takes_video)
        fields, given = create.fields, create.video
        check_model(fields, ctx)
        if create.sources:
            field = create.sources[0].field
            raise bad_request(f"{field}: this route takes only `video` as media", field)
        for kind in control_types_given(fields):  # this route's job is a remix, an edit or an extension
            raise bad_request(f"extra_params.{kind}: a control video steers T2VA requests only (POST /v1/videos)",
                              f"extra_params.{kind}")
        if takes_video and given is None:
            raise bad_request('video: is required (a video file or {"id": ...})', VIDEO_FIELD, "missing_field")
        source_id = video_id if video_id is not None else given if isinstance(given, str) else None
        source = None if source_id is None else await run_in_threadpool(
            completed_job, ctx, source_id, "video_id" if video_id else VIDEO_FIELD)
        job_id = new_job_id()
        try:
            video = await _source_video(ctx, job_id, source, given)
            generation_request, aliases = build(fields.to_request(), video, source)
            generation_request = with_lora(generation_request, create.lora, ctx)
            return await queue_request(job_id, generation_request, {**fields.client_names(), **aliases},
                                       seconds_label(fields, source), ctx)
        except BaseException:
            await run_in_threadpool(ctx.manager.files.remove, job_id)
            raise
    finally:
        await request.close()


async def _source_video(ctx: ServerContext, job_id: str, source: Job | None, given: MediaSource | str | None
                        ) -> MediaRef:
    """The job's source video in its inputs: the completed job's MP4 copied, or the uploaded file stored."""
    if source is not None:
        return await run_in_threadpool(_copy_output, ctx, source, job_id)
    if isinstance(given, MediaSource):
        folder = await run_in_threadpool(ctx.manager.files.inputs_dir, job_id)
        return (await store_media((given,), folder, ctx.fetcher))[0].ref
    raise bad_request('video: is required (a video file or {"id": ...})', VIDEO_FIELD, "missing_field")


def _label(fields: VideoCreateFields, source: Job | None) -> str | None:
    return fields.seconds_label() or (source.seconds if source is not None else None)


async def remix(request: Request, ctx: ServerContext, video_id: str) -> Job:
    def build(given: GenerationRequest, video: MediaRef, source: Job | None) -> tuple[GenerationRequest, Aliases]:
        assert source is not None  # a remix always has its source job
        values = _with_source_defaults(given, source)
        if source.num_frames / limits.FPS <= limits.MEDIA_CLIP_MAX_S:  # fits a Ref2VA video reference
            task = values.task or "ref2va"
            generation = dataclasses.replace(values, task=task, references=(video,), remixed_from_video_id=video_id)
            return generation, {"references[0]": "video_id"}
        generation = dataclasses.replace(values, **remix_of_long(given, source), source_video=video,
                                         remixed_from_video_id=video_id)
        return generation, {"source_video": "video_id"}

    return await _submit(request, ctx, build, _label, video_id=video_id, takes_video=False)


async def edit(request: Request, ctx: ServerContext) -> Job:
    def build(given: GenerationRequest, video: MediaRef, source: Job | None) -> tuple[GenerationRequest, Aliases]:
        values = _with_source_defaults(given, source)
        if values.video_noise_mask is not None or values.audio_noise_mask is not None:
            return dataclasses.replace(values, source_video=video), {"source_video": VIDEO_FIELD}
        task = values.task or "ref2va"
        return dataclasses.replace(values, task=task, references=(video,)), {"references[0]": VIDEO_FIELD}

    return await _submit(request, ctx, build, _label)


async def extend(request: Request, ctx: ServerContext) -> Job:
    def build(given: GenerationRequest, video: MediaRef, source: Job | None) -> tuple[GenerationRequest, Aliases]:
        if given.duration_s is None:
            raise bad_request("seconds: is required (the length of the new part)", "seconds", "missing_field")
        values = dataclasses.replace(_with_source_defaults(given, source), long_video=True,
                                     long_video_mode="continuation")
        return dataclasses.replace(values, extend_video=video), {"extend_video": VIDEO_FIELD}

    def total_seconds(fields: VideoCreateFields, source: Job | None) -> None:
        return None  # the planned duration: the source and the new part together

    return await _submit(request, ctx, build, total_seconds)
