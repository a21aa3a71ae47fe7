"""Video jobs: a durable, bounded FIFO queue and one runner thread that feeds the executor a job at a time.

The queue lives in memory; every job's state lives in a `JobStore` (SQLite in the server) and its files in
`JobFiles`, so a restarted manager finds every job again: finished ones stay finished, queued and in-progress
ones run again from the start, in their original order (generation is deterministic, so a re-run gives the
same output). A running job is cancelled at its next denoise step; a queued one simply leaves the queue.
Nothing here knows about HTTP.
"""

from __future__ import annotations

import logging
import math
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from h3serve import limits
from h3serve.engine.artifacts import write_artifacts
from h3serve.engine.executor import Cancelled, EngineError
from h3serve.engine.output import GenerationOutput
from h3serve.engine.planning import plan_request
from h3serve.engine.storage import JobFiles
from h3serve.media.intake import MediaError
from h3serve.media.mp4 import EncoderOptions
from h3serve.request import GenerationRequest
from h3serve.validate import GenerationPlan, ModelDefaults, RequestError

log = logging.getLogger("h3serve.jobs")

JobStatus = Literal["queued", "in_progress", "completed", "failed"]
UNFINISHED: tuple[JobStatus, ...] = ("queued", "in_progress")
DEFAULT_RETRY_AFTER_S = 30


def new_job_id() -> str:
    return f"video_{secrets.token_hex(16)}"


# Codes of failures the request itself caused (its fields or media failed a check at run time): a client
# error, not a server one. Every other code (generation_failed, output_failed, internal_error) is the server's.
CLIENT_ERROR_CODES = frozenset({"invalid_request", "invalid_media"})
INTERNAL_ERROR_MESSAGE = "the server hit an internal error while running the job"


@dataclass(frozen=True)
class JobError:
    """Why a job failed; `message` is client-safe."""

    code: str
    message: str

    @property
    def client_error(self) -> bool:
        """The request was at fault (an HTTP client gets a 4xx), not the server."""
        return self.code in CLIENT_ERROR_CODES


@dataclass(frozen=True)
class Job:
    """One video job as stored. `seq` (assigned by the store) is the FIFO order; `sync` jobs are never listed."""

    id: str
    model: str
    request: GenerationRequest
    created_at: int
    size: str  # "WxH" of the planned canvas
    seconds: str  # the requested duration, as the OpenAI schema's string
    num_frames: int
    fps: int
    duration_s: float
    status: JobStatus = "queued"
    progress: int = 0
    completed_at: int | None = None
    expires_at: int | None = None
    stage_durations: dict[str, float] = field(default_factory=dict)
    peak_memory_mb: float = 0.0
    inference_time_s: float | None = None
    error: JobError | None = None
    sync: bool = False
    expired: bool = False  # the output files were swept after `expires_at`
    seq: int = 0

    @classmethod
    def planned(cls, job_id: str, model: str, request: GenerationRequest, plan: GenerationPlan, seconds: str,
                created_at: int, sync: bool = False) -> Job:
        return cls(
            id=job_id, model=model, request=request, created_at=created_at, size=f"{plan.width}x{plan.height}",
            seconds=seconds, num_frames=plan.num_frames, fps=limits.FPS, duration_s=plan.duration_s, sync=sync,
        )


class JobStore(Protocol):
    """Durable job records. Every method is atomic and thread-safe."""

    def insert(self, job: Job) -> Job: ...  # returns the job with its `seq`
    def get(self, job_id: str) -> Job | None: ...
    def update(self, job_id: str, **changes: Any) -> None: ...  # no-op for a missing id
    def delete(self, job_id: str) -> bool: ...
    def ids(self) -> set[str]: ...
    def unfinished(self) -> list[Job]: ...  # queued or in progress, by seq
    def sync_jobs(self) -> list[Job]: ...
    def due_to_expire(self, now: int) -> list[Job]: ...  # expires_at <= now and files not yet swept


class ExecutorLike(Protocol):
    """What the manager needs from `h3serve.engine.executor.Executor`."""

    defaults: ModelDefaults
    tasks: tuple[str, ...]  # what the loaded DiTs serve

    def generate(self, plan: GenerationPlan, on_progress: Callable[[int, int], None] | None = None,
                 on_start: Callable[[int], None] | None = None, timeout_s: float | None = None
                 ) -> GenerationOutput: ...
    def cancel(self, seq: int) -> None: ...
    def alive(self) -> bool: ...


class QueueFull(RuntimeError):
    """The queue holds `max_queue` jobs already; try again after `retry_after_s`."""

    def __init__(self, depth: int, retry_after_s: int):
        super().__init__(f"the queue is full ({depth} jobs waiting); retry in about {retry_after_s} s")
        self.depth = depth
        self.retry_after_s = retry_after_s


class ShuttingDown(RuntimeError):
    """The manager is closing and takes no new jobs."""


@dataclass
class _Active:
    """The job the runner holds. `seq` is the executor's handle, known once the executor has taken the job."""

    job_id: str
    seq: int | None = None
    deleted: bool = False
    started: float = field(default_factory=time.monotonic)
    last_progress: float = field(default_factory=time.monotonic)  # /health's stall check


JobListener = Callable[[Job], None]


class JobManager:
    """Owns the queue and the runner thread; the executor runs one job at a time, in submission order."""

    def __init__(
        self,
        executor: ExecutorLike,
        store: JobStore,
        files: JobFiles,
        *,
        max_queue: int = 16,
        output_ttl_s: float | None = None,
        sweep_interval_s: float = 60.0,
        encoder_options: EncoderOptions = EncoderOptions(),  # noqa: B008 (frozen)
        clock: Callable[[], float] = time.time,
        job_timeout_s: float | None = None,
        stall_timeout_s: float | None = None,
    ):
        self.executor = executor
        self.store = store
        self.files = files
        self.max_queue = max_queue
        self.output_ttl_s = output_ttl_s or None
        self.sweep_interval_s = sweep_interval_s
        self.encoder_options = encoder_options
        self.clock = clock
        self.job_timeout_s = job_timeout_s
        self.stall_timeout_s = stall_timeout_s
        self._cond = threading.Condition()
        self._queue: deque[tuple[str, GenerationPlan]] = deque()
        self._active: _Active | None = None
        self._done: dict[str, threading.Event] = {}
        self._listeners: list[JobListener] = []
        self._run_seconds: deque[float] = deque(maxlen=8)
        self._stopping = False
        self._stop_sweeper = threading.Event()
        self._runner: threading.Thread | None = None
        self._sweeper: threading.Thread | None = None

    # -- lifecycle -------------------------------------------------------------------------------------------

    @property
    def defaults(self) -> ModelDefaults:
        return self.executor.defaults

    @property
    def tasks(self) -> tuple[str, ...]:
        return self.executor.tasks

    def start(self) -> None:
        """Recover the stored jobs, then start the runner and the TTL sweeper."""
        self._recover()
        self._runner = threading.Thread(target=self._run_forever, name="h3serve-job-runner", daemon=True)
        self._runner.start()
        self._sweeper = threading.Thread(target=self._sweep_forever, name="h3serve-ttl-sweeper", daemon=True)
        self._sweeper.start()

    def close(self, timeout_s: float = 30.0) -> None:
        """`stop`, then `join`: a running job stops at its next step and stays queued for the next start."""
        self.stop()
        self.join(timeout_s)

    def stop(self) -> None:
        """Stop taking jobs and ask the running one to stop; returns at once. Idempotent.

        From here on a run that ends in `Cancelled` or `EngineError` (its ranks killed by `executor.close`)
        puts its job back in the queue instead of failing it."""
        with self._cond:
            self._stopping = True
            if self._active is not None and self._active.seq is not None:
                self.executor.cancel(self._active.seq)
            self._cond.notify_all()
        self._stop_sweeper.set()

    def drain(self, grace_s: float) -> bool:
        """Graceful stop: take no more jobs, release /sync waiters of queued jobs (they answer 'shutting down'),
        give the running job `grace_s` to finish, then `stop` (cancelling it back into the queue). True if
        nothing was left running."""
        deadline = time.monotonic() + grace_s
        with self._cond:
            self._stopping = True
            for job_id, _ in self._queue:  # they stay queued (and stored) for the next start
                self._finish_waiters(job_id)
            self._cond.notify_all()
            while self._active is not None and (left := deadline - time.monotonic()) > 0:
                self._cond.wait(left)
            finished = self._active is None
        self.stop()
        return finished

    def join(self, timeout_s: float = 30.0) -> bool:
        """Wait for the runner and the sweeper to exit; True once both have (the store may then be closed)."""
        deadline = time.monotonic() + timeout_s
        for thread in (self._runner, self._sweeper):
            if thread is not None:
                thread.join(max(0.0, deadline - time.monotonic()))
        return not any(t is not None and t.is_alive() for t in (self._runner, self._sweeper))

    def healthy(self) -> bool:
        return self.unhealthy_reason() is None

    def unhealthy_reason(self) -> str | None:
        """Why the engine cannot serve (None: it can): the runner or the ranks are gone, or the running job has
        made no progress for `stall_timeout_s` (a stuck engine)."""
        if self._runner is None or not self._runner.is_alive():
            return "the job runner is not running"
        if not self.executor.alive():
            return "the engine's rank processes are not running"
        active = self._active
        if active is not None and self.stall_timeout_s is not None:
            stalled_s = time.monotonic() - active.last_progress
            if stalled_s > self.stall_timeout_s:
                limit = self.stall_timeout_s
                return f"the running job made no progress for {stalled_s:.0f} s (--stall-timeout {limit:g})"
        return None

    def add_listener(self, listener: JobListener) -> None:
        """`listener(job)` is called from the runner thread whenever a job completes or fails."""
        self._listeners.append(listener)

    # -- requests from the API -------------------------------------------------------------------------------

    @property
    def queue_depth(self) -> int:
        return len(self._queue)

    def check_capacity(self) -> None:
        """Raise `QueueFull` now, before a request spends time on uploads and downloads."""
        with self._cond:
            self._check_capacity()

    def _check_capacity(self) -> None:
        if self._stopping:
            raise ShuttingDown("the server is shutting down")
        if len(self._queue) >= self.max_queue:
            raise QueueFull(len(self._queue), self._retry_after_s())

    def _retry_after_s(self) -> int:
        """A slot frees when the running job ends: about one job's duration, from the recent ones."""
        if not self._run_seconds:
            return DEFAULT_RETRY_AFTER_S
        return max(1, math.ceil(sum(self._run_seconds) / len(self._run_seconds)))

    def submit(self, job: Job, plan: GenerationPlan) -> Job:
        """Store `job` and queue it behind the others. Raises `QueueFull` or `ShuttingDown`."""
        with self._cond:
            self._check_capacity()
            job = self.store.insert(job)
            self._queue.append((job.id, plan))
            self._done[job.id] = threading.Event()
            self._cond.notify_all()
        return job

    def done_event(self, job_id: str) -> threading.Event | None:
        """Set once the job completes, fails or is deleted; None when the job is not in the queue or running.

        Lock-free (one dict read), so the event loop can call it without waiting on a store write."""
        return self._done.get(job_id)

    def delete(self, job_id: str) -> bool:
        """Forget a job and its files. A queued job leaves the queue; a running one stops at its next step."""
        with self._cond:
            if not self.store.delete(job_id):
                return False
            if self._active is not None and self._active.job_id == job_id:
                self._active.deleted = True  # the runner removes the files once the executor lets go
                if self._active.seq is not None:
                    self.executor.cancel(self._active.seq)
                return True
            for item in self._queue:
                if item[0] == job_id:
                    self._queue.remove(item)
                    break
            self._finish_waiters(job_id)
        self.files.remove(job_id)
        return True

    # -- runner ----------------------------------------------------------------------------------------------

    def _run_forever(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._stopping:
                    self._cond.wait()
                if self._stopping:
                    return
                job_id, plan = self._queue.popleft()
                active = self._active = _Active(job_id)
            try:
                self._run(active, plan)
            except Exception as e:  # whatever a run raises ends that job, never the runner
                self._record_failure(active, e)
            finally:
                with self._cond:
                    if active.deleted:
                        self.files.remove(job_id)
                    self._active = None
                    self._finish_waiters(job_id)  # after the outcome is stored: a sync waiter reads it next
                    self._cond.notify_all()  # a drain waits for the running job

    def _run(self, active: _Active, plan: GenerationPlan) -> None:
        if active.deleted:  # deleted between leaving the queue and reaching here
            return
        job_id = active.job_id
        reported = [0]

        def on_start(seq: int) -> None:
            with self._cond:
                active.seq = seq
                active.last_progress = time.monotonic()
                if active.deleted or self._stopping:
                    self.executor.cancel(seq)
                else:
                    self.store.update(job_id, status="in_progress")

        def on_progress(done: int, total: int) -> None:
            active.last_progress = time.monotonic()
            percent = min(99, done * 100 // max(total, 1))  # 100 only once the files are written
            if percent > reported[0]:
                reported[0] = percent
                with self._cond:
                    if not active.deleted:
                        self.store.update(job_id, progress=percent)

        output = self.executor.generate(plan, on_progress=on_progress, on_start=on_start, timeout_s=self.job_timeout_s)
        if active.deleted:
            return
        encode_start = time.monotonic()
        try:
            write_artifacts(self.files.job_dir(job_id), output, self.encoder_options)
        except Exception:
            log.exception("job %s: writing the output failed", job_id)
            self._finish(active, status="failed", error=JobError("output_failed", "writing the video file failed"),
                         inference_time_s=time.monotonic() - active.started)
            return
        now = time.monotonic()
        self._run_seconds.append(now - active.started)
        frames = int(output.video.shape[0])
        self._finish(
            active,
            status="completed",
            progress=100,
            num_frames=frames,
            fps=limits.FPS,
            duration_s=frames / limits.FPS,
            stage_durations={**output.stage_durations, "encode": now - encode_start},
            peak_memory_mb=float(output.peak_memory_mb),
            inference_time_s=now - active.started,
        )

    def _record_failure(self, active: _Active, exc: Exception) -> None:
        """End a run that raised: back in the queue when a shutdown stopped it, else failed. Never raises."""
        if active.deleted:  # deleting cancels the run; there is no record left to update
            return
        try:
            error = self._error_for(active, exc)
            if error is None:
                with self._cond:
                    if not active.deleted:
                        self.store.update(active.job_id, status="queued", progress=0)
                return
            # The wall time is recorded for failures too, so they reach the job duration histogram.
            self._finish(active, status="failed", error=error, inference_time_s=time.monotonic() - active.started)
        except Exception:
            log.exception("job %s: recording how it ended failed", active.job_id)

    def _error_for(self, active: _Active, exc: Exception) -> JobError | None:
        """The job's error for what its run raised; None when a shutdown stopped it (the next start reruns it)."""
        client_error = isinstance(exc, EngineError) and exc.client_error
        # Closing cancels the running job, and `executor.close` kills ranks that are still busy (EngineError).
        if self._stopping and (isinstance(exc, Cancelled) or isinstance(exc, EngineError) and not client_error):
            return None
        if isinstance(exc, EngineError):
            return JobError("invalid_request" if client_error else "generation_failed", str(exc))
        if isinstance(exc, TimeoutError) and self.job_timeout_s is not None:
            return JobError("timeout", f"the job ran past the server's job timeout ({self.job_timeout_s:g} s) and was "
                                       "stopped; use a smaller size, a shorter duration or fewer steps")
        # Anything else (TimeoutError, RuntimeError, a bug) is the server's; its text may name paths.
        log.error("job %s: the run failed unexpectedly", active.job_id, exc_info=exc)
        return JobError("internal_error", INTERNAL_ERROR_MESSAGE)

    def _finish(self, active: _Active, **changes: Any) -> None:
        now = int(self.clock())
        changes["completed_at"] = now
        if self.output_ttl_s is not None:
            changes["expires_at"] = now + math.ceil(self.output_ttl_s)
        with self._cond:
            if active.deleted:
                return
            self.store.update(active.job_id, **changes)
        job = self.store.get(active.job_id)
        for listener in self._listeners if job is not None else ():
            try:
                listener(job)
            except Exception:
                log.exception("job listener failed")

    def _finish_waiters(self, job_id: str) -> None:
        event = self._done.pop(job_id, None)
        if event is not None:
            event.set()

    # -- recovery and expiry ---------------------------------------------------------------------------------

    def _recover(self) -> None:
        """Requeue what a previous process left unfinished, in order; drop what no client can still collect."""
        for job in self.store.sync_jobs():  # their HTTP clients went away with the old process
            self.store.delete(job.id)
            self.files.remove(job.id)
        for job in self.store.unfinished():
            if job.status != "queued" or job.progress:
                self.store.update(job.id, status="queued", progress=0)
            try:
                plan = plan_request(job.request, self.defaults, self.tasks)
            except (RequestError, MediaError) as e:  # the model or the input files changed under the job
                code = "invalid_media" if isinstance(e, MediaError) else "invalid_request"
                self.store.update(job.id, status="failed", completed_at=int(self.clock()), error=JobError(code, str(e)))
                continue
            self._queue.append((job.id, plan))
            self._done[job.id] = threading.Event()
        for orphan in self.files.job_ids() - self.store.ids():  # a crash between record and folder removal
            self.files.remove(orphan)
        if self._queue:
            log.info("recovered %d unfinished job(s)", len(self._queue))
        self.sweep_expired()

    def sweep_expired(self) -> int:
        """Delete the files of every job past its `expires_at`; the record stays, marked expired."""
        swept = 0
        for job in self.store.due_to_expire(int(self.clock())):
            with self._cond:
                if self._active is not None and self._active.job_id == job.id:
                    continue
                self.store.update(job.id, expired=True)
            self.files.remove(job.id)
            swept += 1
        return swept

    def _sweep_forever(self) -> None:
        while not self._stop_sweeper.wait(self.sweep_interval_s):
            try:
                self.sweep_expired()
            except Exception:
                log.exception("TTL sweep failed")

