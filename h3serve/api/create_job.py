"""Create a job from an HTTP request: body -> the request model -> stored media -> GenerationRequest -> the job
manager, which plans, admits, records and queues it.

Every failure before the job is queued is a 4xx naming the field, and removes whatever the request had
already stored. Blocking work (file copies, SQLite, media checks) runs in the thread pool, never on the loop.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable

from fastapi import Request
from starlette.concurrency import run_in_threadpool

from h3serve.adapters.catalog import LoraField
from h3serve.api.body import read_body
from h3serve.api.context import ServerContext
from h3serve.api.error_envelope import APIError, bad_request, from_request_error
from h3serve.api.media_fields import media_sources
from h3serve.api.media_inputs import store_media
from h3serve.api.media_routing import media_aliases, place_media
from h3serve.api.request_model import VideoCreateFields
from h3serve.api.request_reader import read_request_fields
from h3serve.api.sync_line import Deadline
from h3serve.engine.admission import TooCostly
from h3serve.engine.jobs.types import QueueFull, ShuttingDown
from h3serve.jobstore.records import Job, new_job_id
from h3serve.media.intake import MediaError
from h3serve.rules import limits
from h3serve.rules.request import GenerationRequest
from h3serve.rules.validate import RequestError

Wait = Callable[[Callable[[], Awaitable[Job]]], Awaitable[Job]]


def _queue_error(err: QueueFull | ShuttingDown) -> APIError:
    if isinstance(err, ShuttingDown):
        return APIError(503, "The server is shutting down; retry later.", "shutting_down")
    return APIError(
        429,
        f"The job queue is full ({err.depth} jobs waiting). Retry after {err.retry_after_s} s.",
        "queue_full",
        headers={"Retry-After": str(err.retry_after_s)},
    )


def _seconds_label(fields: VideoCreateFields) -> str | None:
    """The job's `seconds`: as requested, else what `num_frames` gives (None: the plan's), else the default."""
    label = fields.seconds_label()
    if label is not None or fields.num_frames is not None:
        return label
    return f"{limits.DEFAULT_DURATION_S:g}"


async def ensure_capacity(ctx: ServerContext, sync: bool = False) -> None:
    """A full queue (429) or a closing server (503) answers before any time is spent on the body; a sync request
    with room in the line for a queue slot goes on (h3serve/api/sync_line.py)."""
    try:
        await run_in_threadpool(ctx.manager.check_capacity)
    except QueueFull as e:
        if not (sync and ctx.sync_line.has_room()):
            raise _queue_error(e) from None
    except ShuttingDown as e:
        raise _queue_error(e) from None


def check_model(fields: VideoCreateFields, ctx: ServerContext) -> None:
    """`model`, if given, names the served model (else 400 `model_not_found`)."""
    if fields.model is not None and fields.model != ctx.config.served_model_name:
        raise bad_request(f"model: this server runs {ctx.config.served_model_name!r}, got {fields.model!r}", "model",
                          "model_not_found")


async def submit(request: Request, ctx: ServerContext, *, sync: bool, deadline: Deadline | None = None) -> Job:
    """Parse, store and queue one request. Raises `APIError` with the right status. A sync request
    (`deadline`: its deadline, started when the job is ready to queue) waits for a queue slot until then."""
    try:
        await ensure_capacity(ctx, sync)  # before spending time on uploads
        body = await read_body(request, ctx.config.max_body_bytes)
        fields = await run_in_threadpool(read_request_fields, body)  # JSON text in form fields, long strings
        sources = await run_in_threadpool(media_sources, body)
        lora = fields.lora_field()
        check_model(fields, ctx)
        job_id = new_job_id()
        wait = None
        if sync and deadline is not None:
            async def wait(attempt: Callable[[], Awaitable[Job]]) -> Job:
                return await ctx.sync_line.enter(attempt, deadline.start(), request.is_disconnected)
        try:
            media = []
            if sources:
                folder = await run_in_threadpool(ctx.manager.files.inputs_dir, job_id)
                media = await store_media(sources, folder, ctx.fetcher)
            generation_request = with_lora(place_media(fields.to_request(), media, fields.frame_indices()), lora, ctx)
            aliases = {**fields.client_names(), **media_aliases(generation_request, media)}
            return await queue_request(job_id, generation_request, aliases, _seconds_label(fields), ctx, sync, wait)
        except BaseException:
            await run_in_threadpool(ctx.manager.files.remove, job_id)
            raise
    finally:
        await request.close()  # closes the spooled upload files


def with_lora(generation_request: GenerationRequest, field: LoraField | None, ctx: ServerContext) -> GenerationRequest:
    """The request with its `lora` object resolved against the server's catalog (400 naming the sub-field)."""
    if field is None:
        return generation_request
    if ctx.lora is None:
        raise bad_request("lora: this server serves no LoRA adapters (start it with --lora-path or --lora-dir)", "lora")
    try:
        choice = ctx.lora.choose(field)
    except RequestError as e:
        raise from_request_error(e, {}) from None
    return dataclasses.replace(generation_request, lora=choice)


async def queue_request(
    job_id: str,
    generation_request: GenerationRequest,
    aliases: dict[str, str],
    seconds: str | None,
    ctx: ServerContext,
    sync: bool = False,
    wait: Wait | None = None,
) -> Job:
    """Have the job manager plan, admit, record and queue the request (4xx naming the client's field, per
    `aliases`). Media must be stored already. `seconds`: the job's `seconds` (None: the planned duration).
    `wait`: how a sync request waits for a queue slot (SyncLine.enter); None: a full queue is 429 at once."""
    manager = ctx.manager
    try:
        if wait is None:
            return await run_in_threadpool(manager.submit, generation_request, job_id=job_id, seconds=seconds,
                                           sync=sync)
        prepared = await run_in_threadpool(manager.prepare, generation_request, job_id=job_id, seconds=seconds,
                                           sync=sync)

        async def attempt() -> Job:
            return await run_in_threadpool(manager.enqueue, prepared)

        return await wait(attempt)
    except RequestError as e:
        raise from_request_error(e, aliases) from None
    except MediaError as e:
        param = aliases.get(e.field, e.field)
        raise bad_request(f"{param} ({e.file!r}): {e.message}; limit: {e.limit}", param, "invalid_media") from None
    except TooCostly as e:
        raise bad_request(str(e), None, "request_too_costly") from None
    except (QueueFull, ShuttingDown) as e:
        raise _queue_error(e) from None
