"""The /v1/videos routes: create (async job or synchronous MP4), list, retrieve, download, delete."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Annotated, Literal

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from h3serve.api import derived
from h3serve.api.context import ServerContext, get_context
from h3serve.api.create_job import submit
from h3serve.api.error_envelope import RESERVED_VIDEO_SEGMENTS, APIError, not_found
from h3serve.api.openapi import CREATE_REQUEST_BODY, CREATED_LINKS, derived_body_schema, error_responses
from h3serve.api.output_download import output_response
from h3serve.api.schemas import Video, VideoDeleted, VideoList
from h3serve.api.sync_line import Deadline
from h3serve.jobstore.records import UNFINISHED, Job, JobError
from h3serve.media.previews import VARIANTS, output_file_name
from h3serve.output_store.interface import OutputStoreUnavailable
from h3serve.rules import limits

log = logging.getLogger("h3serve.api")
router = APIRouter(tags=["videos"])
Context = Annotated[ServerContext, Depends(get_context)]
SYNC_POLL_S = 0.05


def _not_a_video(video_id: str) -> None:
    """`sync`, `edits`, `extensions` name the literal routes (POST only): another method there is a 405."""
    if video_id in RESERVED_VIDEO_SEGMENTS:
        raise StarletteHTTPException(405)


def _job(ctx: ServerContext, video_id: str) -> Job:
    job = ctx.store.get(video_id)
    if job is None:
        raise not_found(video_id)
    return job


@router.post(
    "/videos",
    response_model=Video,
    summary="Create a video job (returns at once, status queued)",
    openapi_extra={"requestBody": CREATE_REQUEST_BODY},
    responses={**CREATED_LINKS, **error_responses(400, 401, 413, 415, 429)},
)
async def create_video(request: Request, ctx: Context) -> Video:
    return Video.from_job(await submit(request, ctx, sync=False))


# Literal paths before the {video_id} routes (else POST /videos/edits would meet GET /videos/{video_id}: 405).
@router.post("/videos/edits", response_model=Video, summary="Edit a video (latent-mask edit or Ref2VA re-make)",
             openapi_extra={"requestBody": derived_body_schema(video=True)},
             responses=error_responses(400, 401, 404, 409, 413, 415, 422, 429))
async def edit_video(request: Request, ctx: Context) -> Video:
    return Video.from_job(await derived.edit(request, ctx))


@router.post("/videos/extensions", response_model=Video,
             summary="Extend a video: the source followed by `seconds` more (continuation from its last frames)",
             openapi_extra={"requestBody": derived_body_schema(video=True, required=("prompt", "seconds"))},
             responses=error_responses(400, 401, 404, 409, 413, 415, 422, 429))
async def extend_video(request: Request, ctx: Context) -> Video:
    return Video.from_job(await derived.extend(request, ctx))


@router.post("/videos/{video_id}/remix", response_model=Video,
             summary="Remix a completed video with a new prompt (Ref2VA, the video as the reference)",
             openapi_extra={"requestBody": derived_body_schema(video=False)},
             responses=error_responses(400, 401, 404, 409, 415, 422, 429))
async def remix_video(video_id: str, request: Request, ctx: Context) -> Video:
    return Video.from_job(await derived.remix(request, ctx, video_id))


@router.post(
    "/videos/sync",
    summary="Generate a video and return the MP4 in the response body",
    openapi_extra={"requestBody": CREATE_REQUEST_BODY},
    responses={200: {"content": {"video/mp4": {}}}, **error_responses(400, 401, 413, 415, 429, 500, 503, 504)},
)
async def create_video_sync(request: Request, ctx: Context) -> Response:
    deadline = Deadline(ctx.config.sync_timeout_s)  # the wait for a queue slot and the run together
    job = await submit(request, ctx, sync=True, deadline=deadline)
    try:
        finished = await _wait(ctx, request, job.id, ctx.config.sync_timeout_s, deadline.start())
        if finished is None:
            raise APIError(409, "The video was deleted before it finished.", "video_deleted")
        if finished.status == "failed":
            raise _failure(finished.error)
        if finished.status != "completed":  # a shutdown stopped it and put it back in the queue
            raise APIError(503, "The server is shutting down; retry later.", "shutting_down")
        read = await run_in_threadpool(ctx.manager.outputs.read, job.id, VARIANTS["video"].file_name)
        data = await run_in_threadpool(read.read_all)
    except APIError as e:
        e.headers["X-Request-Id"] = job.id
        raise
    finally:  # a synchronous job lives only as long as its request: aborted (if running) and removed
        try:
            await run_in_threadpool(ctx.manager.delete, job.id)
        except OutputStoreUnavailable as e:  # the answer is ready: the TTL sweep removes the objects later
            log.warning("sync job %s: its objects stay until the output TTL: %s", job.id, e)
    return Response(
        data,
        media_type=VARIANTS["video"].media_type,
        headers={
            "X-Request-Id": job.id,
            "X-Model": finished.model,
            "X-Inference-Time-S": f"{finished.inference_time_s or 0.0:.3f}",
            "X-Stage-Durations": json.dumps(finished.stage_durations, separators=(",", ":")),
            "X-Peak-Memory-MB": f"{finished.peak_memory_mb:.3f}",
            "X-Num-Outputs": str(finished.num_outputs),  # output 0 is the body; the others go with the job
        },
    )


def _failure(error: JobError | None) -> APIError:
    """A failed sync job: 400 when the request was at fault (caught only at run time), else 500."""
    if error is None:  # never stored so; answered as the server's fault
        return APIError(500, "Video generation failed.", "internal_error")
    status = 400 if error.client_error else 500
    return APIError(status, f"Video generation failed: {error.message}", error.code)


async def _wait(ctx: ServerContext, request: Request, job_id: str, timeout_s: float, deadline: float) -> Job | None:
    """The job once it has finished (None if it was deleted); 504 at `deadline` (`timeout_s` after the request
    came), `ClientDisconnect` when the client goes away (either way the caller deletes the job, which cancels it:
    nobody would collect it)."""
    event = ctx.manager.done_event(job_id)
    while event is not None and not event.is_set():
        if time.monotonic() > deadline:
            raise APIError(504, f"Video generation timed out after {timeout_s:g} s; the job was aborted.", "timeout")
        if await request.is_disconnected():
            raise ClientDisconnect(f"the client of sync job {job_id} disconnected; the job was cancelled")
        await asyncio.sleep(SYNC_POLL_S)
    return await run_in_threadpool(ctx.store.get, job_id)


@router.get("/videos", response_model=VideoList, summary="List video jobs", responses=error_responses(400, 401))
def list_videos(
    ctx: Context,
    after: Annotated[str | None, Query(description="id of the last job of the previous page")] = None,
    # 0 is allowed, as vLLM-Omni allows it: an empty page whose has_more says whether any job is listed.
    limit: Annotated[int, Query(ge=0, le=100, description="jobs per page (0: none, only has_more)")] = 20,
    order: Literal["asc", "desc"] = "desc",
) -> VideoList:
    jobs, has_more = ctx.store.page(after, limit, order)
    data = [video for video in map(_listed, jobs) if video is not None]
    return VideoList(
        data=data,
        first_id=data[0].id if data else None,
        last_id=data[-1].id if data else None,
        has_more=has_more,
    )


def _listed(job: Job) -> Video | None:
    """A job as listed; None (logged) for a record that cannot be answered, so one bad row never breaks a page."""
    try:
        video = Video.from_job(job)
        video.model_dump_json()
    except Exception:
        log.exception("job %s cannot be listed; skipped", job.id)
        return None
    return video


@router.get("/videos/{video_id}", response_model=Video, summary="Retrieve a video job",
            responses=error_responses(401, 404))
def retrieve_video(video_id: str, ctx: Context) -> JSONResponse:
    _not_a_video(video_id)
    job = _job(ctx, video_id)
    return JSONResponse(
        Video.from_job(job).model_dump(mode="json"),
        headers={"openai-poll-after-ms": str(ctx.config.poll_after_ms)},
    )


@router.get(
    "/videos/{video_id}/content",
    summary="Download the MP4, its thumbnail (WebP) or its spritesheet (JPEG); `index` picks one of several outputs",
    description="Range requests are served (206), from the data dir or passed through to the bucket. With "
                "--output-redirect the answer is a 302 to a presigned URL of the bucket's object.",
    responses={200: {"content": {v.media_type: {} for v in VARIANTS.values()}},
               206: {"description": "the requested byte range"},
               302: {"description": "--output-redirect: the presigned URL of the object, in Location"},
               **error_responses(400, 401, 404, 409, 416, 422, 503)},
)
def download_video(
    video_id: str,
    request: Request,
    ctx: Context,
    variant: Literal["video", "thumbnail", "spritesheet"] = "video",
    index: Annotated[int, Query(ge=0, le=limits.MAX_OUTPUTS_PER_PROMPT - 1,
                                description="which output of a num_outputs_per_prompt job (output i: seed + i)")] = 0,
) -> Response:
    job = _job(ctx, video_id)
    if index >= job.num_outputs:  # that output does not exist: a 404 naming the parameter
        raise APIError(404, f"index: video '{video_id}' has {job.num_outputs} output(s), 0 to "
                            f"{job.num_outputs - 1}; got {index}", "output_not_found", "index")
    if job.status in UNFINISHED:
        raise APIError(409, f"The video is not ready yet (status {job.status}, {job.progress}%).",
                       "video_not_ready", headers={"x-should-retry": "false"})
    if job.status == "failed":
        raise APIError(422, "Video generation failed; retrieve the job for the error.", "video_failed")
    if job.expired:
        raise APIError(404, f"The files of video '{video_id}' expired and were deleted.", "video_expired")
    spec = VARIANTS[variant]
    name = job.id if job.num_outputs == 1 else f"{job.id}-{index}"
    return output_response(ctx, job.id, output_file_name(variant, index), variant, spec.media_type,
                           f"{name}.{spec.extension}", request.headers.get("range"))


@router.delete("/videos/{video_id}", response_model=VideoDeleted, summary="Delete a job (cancels it if unfinished)",
               responses=error_responses(401, 404, 503))
def delete_video(video_id: str, ctx: Context) -> VideoDeleted:
    _not_a_video(video_id)
    if not ctx.manager.delete(video_id):
        raise not_found(video_id)
    ctx.outbox.wake()  # an unfinished job's deletion wrote its video.failed event
    return VideoDeleted(id=video_id)
