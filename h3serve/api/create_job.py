"""Create a job from an HTTP request: the request read (`intake/read.py`: the request model and its media), made
into a GenerationRequest (`intake/generation_request.py`: media stored and placed), handed to the job manager, which
plans, admits, records and queues it.

Every failure before the job is queued is a 4xx naming the field, and removes whatever the request had
already stored. Blocking work (file copies, SQLite, media checks) runs in the thread pool, never on the loop.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from fastapi import Request
from starlette.concurrency import run_in_threadpool

from h3serve.api.auth import key_scope
from h3serve.api.context import ServerContext
from h3serve.api.error_envelope import APIError, bad_request, from_request_error
from h3serve.api.intake.generation_request import build_generation_request
from h3serve.api.intake.read import read_create_request
from h3serve.api.intake.request_model import VideoCreateFields
from h3serve.api.sync_line import Deadline
from h3serve.engine.admission import TooCostly
from h3serve.engine.jobs.types import QueueFull, ShuttingDown
from h3serve.jobstore.records import Job, new_job_id
from h3serve.media.media_inputs import MediaError
from h3serve.rules import limits
from h3serve.rules.request import GenerationRequest
from h3serve.rules.shown import shown
from h3serve.rules.validate import RequestError

Wait = Callable[[Callable[[], Awaitable[Job]]], Awaitable[Job]]


def _queue_error(err: QueueFull | ShuttingDown) -> APIError:
    if isinstance(err, ShuttingDown):
        return APIError(503, "The server is shutting down; retry later.", "shutting_down")
    return APIError(
        429,
        f"The job queue is full ({err.depth} outputs waiting). Retry after {err.retry_after_s} s.",
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
        raise bad_request(f"model: this server runs {ctx.config.served_model_name!r}, got {shown(fields.model)}",
                          "model", "model_not_found")


async def submit(request: Request, ctx: ServerContext, *, sync: bool, deadline: Deadline | None = None) -> Job:
    """Parse, store and queue one request. Raises `APIError` with the right status. A sync request
    (`deadline`: its deadline, started when the job is ready to queue) waits for a queue slot until then."""
    try:
        await ensure_capacity(ctx, sync)  # before spending time on uploads
        create = await read_create_request(request, ctx.config.max_body_bytes)
        check_model(create.fields, ctx)
        job_id = new_job_id()
        wait = None
        if sync and deadline is not None:
            async def wait(attempt: Callable[[], Awaitable[Job]]) -> Job:
                return await ctx.sync_line.enter(attempt, deadline.start(), request.is_disconnected)
        try:
            generation_request, aliases = await build_generation_request(create, job_id, ctx)
            return await queue_request(job_id, generation_request, aliases, _seconds_label(create.fields), ctx, sync,
                                       wait)
        except BaseException:
            await run_in_threadpool(ctx.manager.files.remove, job_id)
            raise
    finally:
        await request.close()  # closes the spooled upload files


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
    scope = key_scope(ctx.config.api_key)
    try:
        if wait is None:
            return await run_in_threadpool(manager.submit, generation_request, job_id=job_id, seconds=seconds,
                                           sync=sync, key_scope=scope)
        prepared = await run_in_threadpool(manager.prepare, generation_request, job_id=job_id, seconds=seconds,
                                           sync=sync, key_scope=scope)

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
