"""How a job's run ends, recorded once while this server still holds the job: completed with its files written
(and published: publishing.py), failed with its error, back in the queue (a shutdown stopped it), or dropped
(deleted, or claimed by another server after this one's lease ran out)."""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Sequence
from typing import Any

from h3serve.engine.artifacts import discard_files, write_artifacts
from h3serve.engine.executor import Cancelled, EngineError
from h3serve.engine.jobs.book import ActiveJob, JobBook
from h3serve.engine.jobs.staging import Staged
from h3serve.engine.jobs.types import ExecutorLike, JobPolicy
from h3serve.errors import H3ServeError, job_error_for
from h3serve.jobstore.job_files import JobFiles
from h3serve.jobstore.records import FINISHED, JobError
from h3serve.jobstore.store import JobStore
from h3serve.messages import GenerationOutput
from h3serve.rules import limits

log = logging.getLogger("h3serve.jobs")


def job_error(exc: BaseException) -> JobError:
    failure = job_error_for(exc)
    return JobError(failure.code, failure.message)


def _timeline(
    output: GenerationOutput, started: float, encode_start: float, encoded: float
) -> tuple[tuple[str, float, float], ...]:
    """The engine's stage spans and the parent's encode (one time.monotonic clock per host), in seconds since the
    job's run began, in start order."""
    spans = [*output.stage_timeline, ("encode", encode_start, encoded)]
    return tuple((name, round(start - started, 6), round(end - started, 6))
                 for name, start, end in sorted(spans, key=lambda span: span[1]))


class Outcomes:
    """Records how the runs of one manager's jobs end, in its store, under its book's lock."""

    def __init__(
        self, store: JobStore, files: JobFiles, book: JobBook, executors: Sequence[ExecutorLike], policy: JobPolicy
    ):
        self.store = store
        self.files = files
        self.book = book
        self.executors = executors
        self.policy = policy

    def write(self, active: ActiveJob, output: GenerationOutput) -> Staged | None:
        """Write the job's MP4s and previews into its folder (staged; with their manifest when they go on to a
        bucket): what publishing them records once they are in the output store. None when the job was dropped, or
        failed here (recorded). Never raises."""
        job_id = active.job_id
        encode_start = time.monotonic()
        try:
            if active.dropped:
                discard_files(output)
                return None
            job_dir = self.files.job_dir(job_id)
            written = write_artifacts(job_dir, output, active.encoder or self.policy.encoder_options)
            now = time.monotonic()
            frames = output.num_frames
            staged = Staged(written, {
                "progress": 100,
                "num_frames": frames,
                "fps": limits.FPS,
                "duration_s": frames / limits.FPS,
                "stage_durations": {**output.stage_durations, "encode": now - encode_start},
                "stage_timeline": _timeline(output, active.started, encode_start, now),
                "peak_memory_mb": float(output.peak_memory_mb),
                "inference_time_s": now - active.started,
            })
            if self.policy.stage_manifest:  # the data dir store publishes at once: nothing to resume
                staged.save(job_dir)
        except Exception:
            log.exception("job %s: writing the output failed", job_id)
            self.finish(
                active,
                status="failed",
                error=JobError("output_failed", "writing the video file failed"),
                inference_time_s=time.monotonic() - active.started,
            )
            return None
        self.book.record_run(now - active.started)
        return staged

    def complete(self, active: ActiveJob, completion: dict[str, Any]) -> bool:
        """Record the job completed with `completion`'s fields (its files are published); True if recorded.
        Never raises: with the store away the lease runs out and the job is claimed again."""
        try:
            return self.finish(active, status="completed", **completion)
        except Exception:
            log.exception("job %s: recording its completion failed", active.job_id)
            return False

    def drop(self, active: ActiveJob) -> None:
        """This server no longer holds `active`'s job (called under the lock): it was deleted, or another
        server claimed it after this one's lease ran out. Either way the run stops at its next step."""
        job = self.store.get(active.job_id)
        if job is not None and job.owner == self.policy.owner and job.status in FINISHED:
            return  # recorded by this very run a moment ago
        self.book.dropped(active, deleted=job is None)  # deleted: the runner removes the files once it lets go
        if job is not None:
            log.warning("job %s: lease lost to %s; stopping this run", active.job_id, job.owner)
        if active.seq is not None:
            self.executors[active.replica].cancel(active.seq)

    def record_failure(self, active: ActiveJob, exc: Exception) -> None:
        """End a run that raised: back in the queue when a shutdown stopped it, else failed. Never raises."""
        if active.dropped:  # deleted (no record to update) or another server's now
            return
        try:
            error = self._error_for(active, exc)
            if error is None:
                with self.book.cond:
                    if not active.dropped:
                        self.store.release(active.job_id, self.policy.owner)
                return
            # The wall time is recorded for failures too, so they reach the job duration histogram.
            self.finish(active, status="failed", error=error, inference_time_s=time.monotonic() - active.started)
        except Exception:
            log.exception("job %s: recording how it ended failed", active.job_id)

    def _error_for(self, active: ActiveJob, exc: Exception) -> JobError | None:
        """The job's error for what its run raised; None when a shutdown stopped it (the next start reruns it)."""
        client_error = isinstance(exc, EngineError) and exc.client_error
        # Closing cancels the running job, and `executor.close` kills ranks that are still busy (EngineError).
        if self.book.stopping and (isinstance(exc, Cancelled) or isinstance(exc, EngineError) and not client_error):
            return None
        timeout_s = self.policy.job_timeout_s
        if isinstance(exc, TimeoutError) and timeout_s is not None:
            return JobError(
                "timeout",
                f"the job ran past the server's job timeout ({timeout_s:g} s) and was "
                "stopped; use a smaller size, a shorter duration or fewer steps",
            )
        if not isinstance(exc, H3ServeError):  # a bug, an OSError: the server's, and its text may name paths
            log.error("job %s: the run failed unexpectedly", active.job_id, exc_info=exc)
        error = job_error(exc)
        return JobError(error.code, self._without_paths(active.job_id, error.message))

    def _without_paths(self, job_id: str, message: str) -> str:
        """A client-visible message with the job's files named relative to the job (`inputs/00-clip.mp4`) and the
        server's jobs folder left out, whatever layer wrote the path into it."""
        for folder, name in ((self.files.job_dir(job_id), "the job's folder"), (self.files.root, "the jobs folder")):
            for form in {str(folder), str(folder.resolve())}:
                message = message.replace(form + os.sep, "").replace(form, name)
        return message

    def finish(self, active: ActiveJob, **changes: Any) -> bool:
        """Record the run's outcome, once, while this server still holds the job; then tell the listeners (the
        webhook worker among them). True if recorded (False: the job was dropped meanwhile). `store.finish` writes
        the job's webhook event in the same transaction as its final state (h3serve/jobstore/webhook_sql.py):
        recorded here means its event is in the outbox."""
        now = int(self.policy.clock())
        changes["completed_at"] = now
        if self.policy.output_ttl_s is not None:
            changes["expires_at"] = now + math.ceil(self.policy.output_ttl_s)
        with self.book.cond:
            if active.dropped:
                return False
            if not self.store.finish(active.job_id, self.policy.owner, **changes):
                self.drop(active)
                return False
        job = self.store.get(active.job_id)
        if job is None:  # deleted since
            return True
        for listener in self.book.listeners:
            try:
                listener(job)
            except Exception:
                log.exception("job listener failed")
        return True
