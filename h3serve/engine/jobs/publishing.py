"""Publishing a job's outputs: its files, written (staged) into its folder in the data dir, are put into the output
store and checked there with a HEAD each; only then is the job recorded completed.

- The data dir store (the default): the files are already in place; the HEADs are a check that they are.
- A bucket: the upload pool uploads them (streamed, multipart for large files) off the runner and finisher
  threads, so slow storage holds neither the ranks nor the next job's mux, and never the event loop. A failed
  attempt is retried with exponential backoff; after the last one the job fails with the store's reason.
  Once recorded, the staged copies are removed from the data dir.

For a bucket, staging leaves a manifest (`.staged.json`: the file names, their media types and the completion's
fields) beside the files once all are written. A job claimed again after its server died or stopped mid-upload (a
restart on the same data dir) finds the manifest and is published from it instead of being run again; one
claimed where its staged files are not (another server's disk) runs again and writes the same keys. A bucket shows
an object only once its upload is complete, so a half object is never served.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_for

from h3serve.engine.jobs.book import ActiveJob, JobBook
from h3serve.engine.jobs.outcomes import Outcomes
from h3serve.engine.jobs.staging import STAGED_MANIFEST, Staged
from h3serve.engine.jobs.types import JobPolicy
from h3serve.jobstore.job_files import JobFiles
from h3serve.jobstore.records import FINISHED, JobError
from h3serve.jobstore.store import JobStore
from h3serve.output_store.interface import OutputStore, OutputStoreUnavailable

log = logging.getLogger("h3serve.jobs")

UPLOAD_WORKERS = 4  # jobs uploading at once (each uploads its files one by one, a large one in parallel parts)
MAX_BACKOFF_S = 30.0
Release = Callable[[ActiveJob], None]


class Publisher:
    """Publishes one manager's staged outputs and removes jobs' files, here and in the output store."""

    def __init__(self, store: JobStore, files: JobFiles, outputs: OutputStore, book: JobBook, outcomes: Outcomes,
                 policy: JobPolicy):
        self.store = store
        self.files = files
        self.outputs = outputs
        self.book = book
        self.outcomes = outcomes
        self.policy = policy
        self._pool = ThreadPoolExecutor(UPLOAD_WORKERS, thread_name_prefix="h3serve-upload") if outputs.remote \
            else None
        self._pending: set[Future[None]] = set()
        self._pending_lock = threading.Lock()

    # -- publishing ---------------------------------------------------------------------------------------------

    def staged(self, job_id: str) -> Staged | None:
        """The job's complete staged outputs in this data dir (written before a crash or a stop), if any."""
        return Staged.load(self.files.job_dir(job_id))

    def publish(self, active: ActiveJob, staged: Staged, release: Release) -> None:
        """Record `active`'s job completed once `staged` is in the output store, then `release` it. Into the data
        dir: now, in this thread. Into a bucket: by the upload pool; this returns at once. Never raises."""
        if self._pool is None:
            try:
                self._publish(active, staged)
            finally:
                release(active)
            return
        self.book.uploading(active)  # the job stays held (its lease renewed) while it uploads

        def upload_then_release() -> None:
            try:
                self._publish(active, staged)
            finally:
                release(active)

        future = self._pool.submit(upload_then_release)
        with self._pending_lock:
            self._pending.add(future)
        future.add_done_callback(self._done)

    def _done(self, future: Future[None]) -> None:
        with self._pending_lock:
            self._pending.discard(future)

    def join(self, timeout_s: float) -> bool:
        """Wait for the uploads in flight; True once none is left."""
        with self._pending_lock:
            pending = set(self._pending)
        return not wait_for(pending, timeout=max(0.0, timeout_s)).not_done if pending else True

    def _publish(self, active: ActiveJob, staged: Staged) -> None:
        """Put, check, record; retried with backoff while the store is unreachable. Never raises."""
        job_id = active.job_id
        started = time.monotonic()
        attempts = self.policy.upload_attempts if self.outputs.remote else 1  # a file missing here is no outage
        for attempt in range(1, attempts + 1):
            if active.dropped:
                return
            try:
                self._put_and_check(job_id, staged)
                break
            except OutputStoreUnavailable as e:
                final = attempt == attempts
                self._tell("failed" if final else "retried", 0, 0.0)
                log.warning("job %s: publishing its outputs failed (attempt %d of %d): %s", job_id, attempt, attempts,
                            e)
                if final:
                    self._fail(active, staged, e, attempts)
                    return
                delay = min(MAX_BACKOFF_S, self.policy.upload_backoff_s * 2 ** (attempt - 1))
                if self.book.stop_background.wait(delay):  # stopping: the next start publishes the staged files
                    self._requeue(active)
                    return
            except Exception:  # a bug, a staged file gone: the server's fault
                log.exception("job %s: publishing its outputs failed", job_id)
                self._fail(active, staged, None, attempt)
                return
        completion = dict(staged.completion)
        if self.outputs.remote:
            completion["stage_durations"] = {**completion.get("stage_durations", {}),
                                             "upload": time.monotonic() - started}
        # The staged copies go before the record: a restart in between runs the job again (same keys, same bytes).
        self._unstage(job_id, staged, keep_files=not self.outputs.remote)
        self.outcomes.complete(active, completion)

    def _put_and_check(self, job_id: str, staged: Staged) -> None:
        """Upload each staged file (a bucket), then HEAD each: present, with the staged size."""
        job_dir = self.files.job_dir(job_id)
        if self.outputs.remote:
            for name, media_type in staged.files.items():
                path = job_dir / name
                size, began = path.stat().st_size, time.monotonic()
                self.outputs.upload(job_id, name, path, media_type)
                self._tell("uploaded", size, time.monotonic() - began)
        for name in staged.files:
            stored = self.outputs.head(job_id, name)
            size = (job_dir / name).stat().st_size
            if stored is None or stored.size != size:
                found = "missing" if stored is None else f"{stored.size} bytes, not {size}"
                raise OutputStoreUnavailable(f"{self.outputs.describe()}: {name} of {job_id} is {found} after "
                                             "its upload", f"checking {name} after its upload found it {found}")

    def _tell(self, outcome: str, size: int, seconds: float) -> None:
        for listener in self.book.upload_listeners:
            try:
                listener(outcome, size, seconds)
            except Exception:
                log.exception("upload listener failed")

    def _fail(self, active: ActiveJob, staged: Staged, error: OutputStoreUnavailable | None, attempts: int) -> None:
        if error is None:
            job_error = JobError("output_failed", "storing the video files failed")
        else:
            job_error = JobError(error.code, f"storing the video files in the output store failed after {attempts} "
                                             f"attempt(s): {error.reason}")
        self._unstage(active.job_id, staged, keep_files=False)
        self.outcomes.finish(active, status="failed", error=job_error,
                             inference_time_s=time.monotonic() - active.started)

    def _requeue(self, active: ActiveJob) -> None:
        """The server stops mid-retry: the job goes back to the queue, its staged files kept for the next start."""
        try:
            with self.book.cond:
                if not active.dropped:
                    self.store.release(active.job_id, self.policy.owner)
        except Exception:  # the lease runs out instead, with the same result
            log.exception("job %s: putting it back in the queue failed", active.job_id)

    def _unstage(self, job_id: str, staged: Staged, keep_files: bool) -> None:
        """Remove the manifest, and unless `keep_files` the staged outputs (a bucket holds them now, or the job
        failed); the data dir store keeps its published files."""
        job_dir = self.files.job_dir(job_id)
        for name in [STAGED_MANIFEST, *([] if keep_files else staged.files)]:
            try:
                (job_dir / name).unlink(missing_ok=True)
            except OSError:
                log.warning("job %s: removing its staged %s failed", job_id, name, exc_info=True)

    def drop_stale_staging(self) -> int:
        """Start-up, with a bucket: remove the staged outputs of jobs recorded finished (another server reran and
        published them after this one died mid-upload) or gone; their inputs stay with their folders. How many."""
        if not self.outputs.remote:
            return 0  # the data dir store's staged files are its published ones
        dropped = 0
        for job_id in self.files.job_ids():
            staged = self.staged(job_id)
            if staged is None:
                continue
            job = self.store.get(job_id)
            if job is None or job.status in FINISHED:
                self._unstage(job_id, staged, keep_files=False)
                dropped += 1
        return dropped

    # -- removal ------------------------------------------------------------------------------------------------

    def remove_published(self, job_id: str) -> None:
        """Remove the job's objects from a bucket (`OutputStoreUnavailable` if it cannot); the data dir store's
        files go with the job's folder (`forget`)."""
        if self.outputs.remote:
            self.outputs.remove(job_id)

    def forget(self, job_id: str) -> None:
        """Remove every file of the job: its folder here and its objects in a bucket. Never raises: objects the
        bucket keeps (unreachable now) are logged; a bucket lifecycle rule is the backstop (docs/output_store.md)."""
        self.files.remove(job_id)
        try:
            self.remove_published(job_id)
        except OutputStoreUnavailable as e:
            log.warning("job %s: its objects stay in the bucket: %s", job_id, e)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)
