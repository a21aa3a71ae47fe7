"""Video jobs: a durable FIFO queue that lives in the job store, and one runner thread per engine replica.

The queue *is* the store (`h3serve.jobstore`): a runner claims the oldest queued job under a lease, renews
the lease on a heartbeat while the job runs, and records the outcome conditioned on still holding it. So one
replica, N replicas in one server, or many servers on one PostgreSQL database run the same code path, and a
job whose server died is claimed again once its lease runs out (generation is deterministic, so a rerun
gives the same output). A restarted server finds every job again: finished ones stay finished, queued and
in-progress ones run again from the start, in their original order. A running job is cancelled at its next
denoise step (a delete on another server reaches the owner through its lease renewal); a queued one is
simply removed from the store. Nothing here knows about HTTP.

Output overlap (the default): once a job's engine run ends, a finisher thread of its replica writes the MP4
(the mux) and records the outcome while the replica's runner already claims and runs the next job. Each replica
has at most one job finishing, so at most one decoded output waits beside the running job; the files and the
record are the same as without overlap (`overlap_output=False` writes them before the next job starts).
"""

from __future__ import annotations

import logging
import math
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from h3serve import limits
from h3serve.engine.artifacts import discard_files, write_artifacts
from h3serve.engine.executor import Cancelled, EngineError
from h3serve.engine.job_types import ExecutorLike, JobListener, QueueFull, ReplicaStatus, ShuttingDown, StartListener
from h3serve.engine.output import GenerationOutput
from h3serve.engine.planning import plan_request
from h3serve.errors import H3ServeError, job_error_for
from h3serve.jobstore.files import JobFiles
from h3serve.jobstore.protocol import JobStore
from h3serve.jobstore.records import FINISHED, Job, JobError
from h3serve.media.intake import MediaError
from h3serve.media.mp4 import EncoderOptions
from h3serve.validate import GenerationPlan, ModelDefaults, RequestError

log = logging.getLogger("h3serve.jobs")

DEFAULT_RETRY_AFTER_S = 30
DEFAULT_LEASE_S = 30.0  # a dead server's job is claimed again this long after its last renewal
DEFAULT_POLL_S = 0.5  # idle runners look for work this often (a local submit wakes them at once)
ORPHAN_AGE_S = 3600.0  # shared data dir: a job folder without a record is removed once this old


def server_name() -> str:
    """A name no other live server has: host, pid and a random tag (a restarted process is a new owner)."""
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"


@dataclass
class _Active:
    """A job a replica holds. `seq` is the executor's handle, known once the executor has taken the job."""

    job_id: str
    replica: int
    seq: int | None = None
    deleted: bool = False
    lost: bool = False  # another server holds the job now (this one's lease ran out): its result is not ours
    started: float = field(default_factory=time.monotonic)
    last_progress: float = field(default_factory=time.monotonic)  # /health's stall check

    @property
    def dropped(self) -> bool:
        return self.deleted or self.lost


class JobManager:
    """Owns the runner threads (one per executor: the engine replicas), the lease heartbeat and the TTL sweeper.
    Jobs run in submission order; each replica runs one job at a time."""

    def __init__(
        self,
        executor: ExecutorLike | Sequence[ExecutorLike],
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
        lease_s: float = DEFAULT_LEASE_S,
        poll_s: float = DEFAULT_POLL_S,
        owner: str | None = None,
        overlap_output: bool = True,
    ):
        self.executors: list[ExecutorLike] = list(executor) if isinstance(executor, Sequence) else [executor]
        if not self.executors:
            raise ValueError("a job manager needs at least one executor")
        self.store = store
        self.files = files
        self.max_queue = max_queue
        self.output_ttl_s = output_ttl_s or None
        self.sweep_interval_s = sweep_interval_s
        self.encoder_options = encoder_options
        self.clock = clock
        self.job_timeout_s = job_timeout_s
        self.stall_timeout_s = stall_timeout_s
        self.lease_s = lease_s
        self.poll_s = poll_s
        self.owner = owner or server_name()
        self.overlap_output = overlap_output
        self._cond = threading.Condition()
        self._wakeups = 0  # bumped on every local submit: a runner that saw no job re-checks before waiting
        self._plans: dict[str, GenerationPlan] = {}  # plans of jobs planned here (a claim elsewhere re-plans)
        self._active: dict[int, _Active] = {}  # replica -> the job it runs
        self._finishing: dict[int, _Active] = {}  # replica -> its job whose output is being written
        self._finishers: dict[int, threading.Thread] = {}  # replica -> the thread writing it
        self._served = [0] * len(self.executors)
        self._counters: list[dict[str, int]] = [{} for _ in self.executors]  # as of each replica's last output
        self._done: dict[str, threading.Event] = {}
        self._listeners: list[JobListener] = []
        self._start_listeners: list[StartListener] = []
        self._run_seconds: list[float] = []
        self._stopping = False
        self._stop_background = threading.Event()
        self._runners: list[threading.Thread] = []
        self._background: list[threading.Thread] = []

    # -- lifecycle -------------------------------------------------------------------------------------------

    @property
    def executor(self) -> ExecutorLike:
        """The first replica's executor (the only one without data parallelism)."""
        return self.executors[0]

    @property
    def defaults(self) -> ModelDefaults:
        return self.executor.defaults

    @property
    def tasks(self) -> tuple[str, ...]:
        return self.executor.tasks

    def start(self) -> None:
        """Recover the stored jobs, then start the runners, the lease heartbeat and the TTL sweeper."""
        self._recover()
        self._runners = [
            threading.Thread(target=self._run_forever, args=(i,), name=f"h3serve-job-runner-{i}", daemon=True)
            for i in range(len(self.executors))
        ]
        self._background = [
            threading.Thread(target=self._heartbeat_forever, name="h3serve-lease-heartbeat", daemon=True),
            threading.Thread(target=self._sweep_forever, name="h3serve-ttl-sweeper", daemon=True),
        ]
        for thread in (*self._runners, *self._background):
            thread.start()

    def close(self, timeout_s: float = 30.0) -> None:
        """`stop`, then `join`: running jobs stop at their next step and go back to the queue."""
        self.stop()
        self.join(timeout_s)

    def stop(self) -> None:
        """Stop taking jobs and ask the running ones to stop; returns at once. Idempotent.

        From here on a run that ends in `Cancelled` or `EngineError` (its ranks killed by `executor.close`)
        puts its job back in the queue instead of failing it."""
        with self._cond:
            self._stopping = True
            for active in self._active.values():
                if active.seq is not None:
                    self.executors[active.replica].cancel(active.seq)
            self._cond.notify_all()
        self._stop_background.set()

    def drain(self, grace_s: float) -> bool:
        """Graceful stop: take no more jobs, release /sync waiters of queued jobs (they answer 'shutting down'),
        give the running jobs `grace_s` to finish, then `stop` (cancelling them back into the queue). True if
        nothing was left running."""
        deadline = time.monotonic() + grace_s
        with self._cond:
            self._stopping = True
            running = {a.job_id for a in self._held()}
            for job_id in [j for j in self._done if j not in running]:  # they stay queued for the next start
                self._finish_waiters(job_id)
            self._cond.notify_all()
            while self._held() and (left := deadline - time.monotonic()) > 0:
                self._cond.wait(left)
            finished = not self._held()
        self.stop()
        return finished

    def join(self, timeout_s: float = 30.0) -> bool:
        """Wait for every thread to exit; True once all have (the store may then be closed)."""
        deadline = time.monotonic() + timeout_s
        threads = (*self._runners, *self._background)
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        return not any(t.is_alive() for t in threads)

    def healthy(self) -> bool:
        return self.unhealthy_reason() is None

    def unhealthy_reason(self) -> str | None:
        """Why the server cannot serve (None: it can): every replica has a problem (see `replicas`)."""
        problems = [r.problem for r in self.replicas()]
        if not all(problems):
            return None
        if len(problems) == 1:
            return problems[0]
        return "; ".join(f"replica {i}: {p}" for i, p in enumerate(problems))

    def replicas(self) -> list[ReplicaStatus]:
        """Each replica's state. Its problem: the runner or the ranks are gone, or its running job has made no
        progress for `stall_timeout_s` (a stuck engine)."""
        return [self._replica_status(i) for i in range(len(self.executors))]

    def _replica_status(self, i: int) -> ReplicaStatus:
        active = self._active.get(i)
        problem = None
        if len(self._runners) <= i or not self._runners[i].is_alive():
            problem = "the job runner is not running"
        elif not self.executors[i].alive():
            problem = "the engine's rank processes are not running"
        elif active is not None and self.stall_timeout_s is not None:
            stalled_s = time.monotonic() - active.last_progress
            if stalled_s > self.stall_timeout_s:
                limit = self.stall_timeout_s
                problem = f"the running job made no progress for {stalled_s:.0f} s (--stall-timeout {limit:g})"
        job_id = active.job_id if active else None
        return ReplicaStatus(i, active is not None, job_id, self._served[i], problem, dict(self._counters[i]))

    def add_listener(self, listener: JobListener) -> None:
        """`listener(job)` is called from a runner thread whenever a job completes or fails."""
        self._listeners.append(listener)

    def add_start_listener(self, listener: StartListener) -> None:
        """`listener(replica, queue_wait_s)` is called from a runner thread whenever it takes a job."""
        self._start_listeners.append(listener)

    # -- requests from the API -------------------------------------------------------------------------------

    @property
    def queue_depth(self) -> int:
        return self.store.count_queued()

    def check_capacity(self) -> None:
        """Raise `QueueFull` now, before a request spends time on uploads and downloads."""
        with self._cond:
            self._check_capacity()

    def _check_capacity(self) -> None:
        if self._stopping:
            raise ShuttingDown("the server is shutting down")
        depth = self.store.count_queued()  # every server's queued jobs, on a shared store
        if depth >= self.max_queue:
            raise QueueFull(depth, self._retry_after_s())

    def _retry_after_s(self) -> int:
        """A slot frees when a running job ends: about one job's duration, from the recent ones."""
        recent = self._run_seconds[-8:]
        if not recent:
            return DEFAULT_RETRY_AFTER_S
        return max(1, math.ceil(sum(recent) / len(recent) / len(self.executors)))

    def submit(self, job: Job, plan: GenerationPlan) -> Job:
        """Store `job` in the queue behind the others. Raises `QueueFull` or `ShuttingDown`.

        A sync job is leased to this server from the start: only it may run the job (its HTTP client waits
        here), and if this server dies the lease runs out and any server deletes the job."""
        with self._cond:
            self._check_capacity()
            if job.sync:
                job = replace(job, owner=self.owner, lease_expires_at=time.time() + self.lease_s)
            job = self.store.insert(job)
            self._plans[job.id] = plan
            self._done[job.id] = threading.Event()
            self._wakeups += 1
            self._cond.notify_all()
        return job

    def done_event(self, job_id: str) -> threading.Event | None:
        """Set once the job completes, fails or is deleted; None when this server is not tracking it.

        Lock-free (one dict read), so the event loop can call it without waiting on a store write."""
        return self._done.get(job_id)

    def delete(self, job_id: str) -> bool:
        """Forget a job and its files. A queued job leaves the queue; a running one stops at its next step
        (on another server: once that server's lease renewal finds the record gone)."""
        with self._cond:
            job = self.store.get(job_id)
            if job is None or not self.store.delete(job_id):
                return False
            active = self._find_active(job_id)
            if active is not None:
                active.deleted = True  # the runner removes the files once the executor lets go
                if active.seq is not None:
                    self.executors[active.replica].cancel(active.seq)
                return True
            self._plans.pop(job_id, None)
            self._finish_waiters(job_id)
        running_elsewhere = (job.status == "in_progress" and job.owner != self.owner
                             and (job.lease_expires_at or 0) > time.time())
        if not running_elsewhere:  # else its owner removes them once it lets go (it may be writing them)
            self.files.remove(job_id)
        return True

    def _held(self) -> list[_Active]:
        """Every job this server holds: running on a replica, or having its output written."""
        return [*self._active.values(), *self._finishing.values()]

    def _find_active(self, job_id: str) -> _Active | None:
        return next((a for a in self._held() if a.job_id == job_id), None)

    # -- runners ---------------------------------------------------------------------------------------------

    def _claim(self, replica: int) -> tuple[Job, _Active] | None:
        """The next job for `replica`, registered as active (under the lock, so a delete sees it), or None
        after waiting for a wake-up; None also once stopping."""
        with self._cond:
            while not self._stopping:
                seen = self._wakeups
                try:
                    job = self.store.claim(self.owner, self.lease_s)
                except Exception:
                    log.exception("claiming a job from the store failed; retrying")
                    job = None
                if job is not None and self._find_active(job.id) is not None:
                    # Our own running job, its lease run out (a heartbeat held up): the claim renewed it.
                    log.warning("job %s: lease ran out while running here; renewed", job.id)
                elif job is not None:
                    active = self._active[replica] = _Active(job.id, replica)
                    return job, active
                if self._wakeups == seen:
                    self._cond.wait(self.poll_s)
            return None

    def _run_forever(self, replica: int) -> None:
        try:
            while (claimed := self._claim(replica)) is not None:
                job, active = claimed
                waited = max(0.0, self.clock() - job.created_at)
                for listener in self._start_listeners:
                    try:
                        listener(replica, waited)
                    except Exception:
                        log.exception("job start listener failed")
                output = None
                try:
                    plan = self._plan_for(job, active)
                    if plan is not None:
                        output = self._run(active, plan)
                except Exception as e:  # whatever a run raises ends that job, never the runner
                    self._record_failure(active, e)
                if output is not None and self.overlap_output:
                    self._hand_off(active, output)  # written while this runner takes the next job
                else:
                    if output is not None:
                        self._write_and_finish(active, output)
                    self._release(active)
        finally:
            finisher = self._finishers.get(replica)
            if finisher is not None:
                finisher.join()  # the runner ends once its last output is written

    def _hand_off(self, active: _Active, output: GenerationOutput) -> None:
        """Give the job to the replica's finisher thread (after its previous one is written) and free the replica."""
        replica = active.replica
        previous = self._finishers.get(replica)
        if previous is not None:
            previous.join()  # one job finishing per replica: bounded memory, outcomes recorded in order

        def finish() -> None:
            try:
                self._write_and_finish(active, output)
            finally:
                self._release(active)

        with self._cond:
            del self._active[replica]
            self._finishing[replica] = active
        thread = threading.Thread(target=finish, name=f"h3serve-job-finisher-{replica}", daemon=True)
        self._finishers[replica] = thread
        thread.start()

    def _release(self, active: _Active) -> None:
        """The job leaves this server's hands: remove a deleted job's files, count it, wake its waiters."""
        with self._cond:
            if active.deleted:
                self.files.remove(active.job_id)
            replica = active.replica
            if self._active.get(replica) is active:
                del self._active[replica]
            if self._finishing.get(replica) is active:
                del self._finishing[replica]
            self._served[replica] += 1
            self._plans.pop(active.job_id, None)
            self._finish_waiters(active.job_id)  # after the outcome is stored: a sync waiter reads it next
            self._cond.notify_all()  # a drain waits for the held jobs

    def _plan_for(self, job: Job, active: _Active) -> GenerationPlan | None:
        """The job's plan: the one made at submission, else planned again (a job submitted to another server,
        or before a restart); None after failing the job when its request no longer plans."""
        plan = self._plans.get(job.id)
        if plan is not None:
            return plan
        try:
            return plan_request(job.request, self.defaults, self.tasks)
        except (RequestError, MediaError) as e:  # the model or the input files changed under the job
            self._finish(active, status="failed", error=_job_error(e))
            return None

    def _run(self, active: _Active, plan: GenerationPlan) -> GenerationOutput | None:
        """The engine run of the job; its output, or None when the job was dropped meanwhile."""
        executor = self.executors[active.replica]
        job_id = active.job_id
        reported = [0]

        def on_start(seq: int) -> None:
            with self._cond:
                active.seq = seq
                active.last_progress = time.monotonic()
                if active.dropped or self._stopping:
                    executor.cancel(seq)

        def on_progress(done: int, total: int) -> None:
            active.last_progress = time.monotonic()
            percent = min(99, done * 100 // max(total, 1))  # 100 only once the files are written
            if percent > reported[0]:
                reported[0] = percent
                with self._cond:
                    if active.dropped:
                        return
                    try:
                        held = self.store.update_owned(job_id, self.owner, progress=percent)
                    except Exception:  # the database is briefly away: the lease decides, not a progress tick
                        log.warning("job %s: recording progress failed", job_id, exc_info=True)
                        return
                    if not held:
                        self._drop(active)

        output = executor.generate(plan, on_progress=on_progress, on_start=on_start, timeout_s=self.job_timeout_s,
                                   encoder=self.encoder_options)
        self._counters[active.replica] = dict(output.counters)
        return None if active.dropped else output

    def _write_and_finish(self, active: _Active, output: GenerationOutput) -> None:
        """Write the job's MP4 (and its other artifacts) and record it completed; never raises."""
        job_id = active.job_id
        encode_start = time.monotonic()
        try:
            if active.dropped:
                discard_files(output)
                return
            write_artifacts(self.files.job_dir(job_id), output, self.encoder_options)
        except Exception:
            log.exception("job %s: writing the output failed", job_id)
            self._finish(active, status="failed", error=JobError("output_failed", "writing the video file failed"),
                         inference_time_s=time.monotonic() - active.started)
            return
        now = time.monotonic()
        self._run_seconds = [*self._run_seconds[-7:], now - active.started]
        frames = output.num_frames
        try:
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
        except Exception:  # the store is away: the lease runs out and the job is claimed and run again
            log.exception("job %s: recording its completion failed", job_id)

    def _drop(self, active: _Active) -> None:
        """This server no longer holds `active`'s job (called under the lock): it was deleted, or another
        server claimed it after this one's lease ran out. Either way the run stops at its next step."""
        job = self.store.get(active.job_id)
        if job is not None and job.owner == self.owner and job.status in FINISHED:
            return  # recorded by this very run a moment ago
        if job is None:
            active.deleted = True  # the runner removes the files once the executor lets go
        else:
            active.lost = True
            log.warning("job %s: lease lost to %s; stopping this run", active.job_id, job.owner)
        if active.seq is not None:
            self.executors[active.replica].cancel(active.seq)

    def _record_failure(self, active: _Active, exc: Exception) -> None:
        """End a run that raised: back in the queue when a shutdown stopped it, else failed. Never raises."""
        if active.dropped:  # deleted (no record to update) or another server's now
            return
        try:
            error = self._error_for(active, exc)
            if error is None:
                with self._cond:
                    if not active.dropped:
                        self.store.release(active.job_id, self.owner)
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
        if isinstance(exc, TimeoutError) and self.job_timeout_s is not None:
            return JobError("timeout", f"the job ran past the server's job timeout ({self.job_timeout_s:g} s) and was "
                                       "stopped; use a smaller size, a shorter duration or fewer steps")
        if not isinstance(exc, H3ServeError):  # a bug, an OSError: the server's, and its text may name paths
            log.error("job %s: the run failed unexpectedly", active.job_id, exc_info=exc)
        return _job_error(exc)

    def _finish(self, active: _Active, **changes: Any) -> None:
        """Record the run's outcome, once, while this server still holds the job; then tell the listeners."""
        now = int(self.clock())
        changes["completed_at"] = now
        if self.output_ttl_s is not None:
            changes["expires_at"] = now + math.ceil(self.output_ttl_s)
        with self._cond:
            if active.dropped:
                return
            if not self.store.finish(active.job_id, self.owner, **changes):
                self._drop(active)
                return
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

    # -- leases ----------------------------------------------------------------------------------------------

    def _heartbeat_forever(self) -> None:
        while not self._stop_background.wait(self.lease_s / 3):
            try:
                self.heartbeat()
            except Exception:
                log.exception("renewing the job leases failed (the jobs run on; another server may claim "
                              "them once the leases run out)")

    def heartbeat(self) -> None:
        """Renew this server's leases; stop runs whose job was deleted or claimed elsewhere. On a shared store
        also delete orphaned sync jobs and forget jobs submitted here that another server finished."""
        with self._cond:  # the jobs this server runs, and its sync jobs (their clients wait here)
            mine = {a.job_id for a in self._held()} | set(self._done)
        held = self.store.renew(self.owner, self.lease_s, mine)
        with self._cond:
            for active in self._held():
                if active.job_id not in held and not active.dropped:
                    self._drop(active)
        if not self.store.shared:
            return
        for job_id in self.store.reap_orphaned_sync():
            self.files.remove(job_id)
        with self._cond:
            running = {a.job_id for a in self._held()}
            tracked = [j for j in set(self._done) | set(self._plans) if j not in running]
        for job_id in tracked:
            job = self.store.get(job_id)
            if job is None or job.status in FINISHED or job.owner not in (None, self.owner):
                with self._cond:
                    self._plans.pop(job_id, None)
                    self._finish_waiters(job_id)

    # -- recovery and expiry ---------------------------------------------------------------------------------

    def _recover(self) -> None:
        """Make the stored queue runnable. A store only this server uses: requeue what a previous process left
        unfinished, in order (failing what no longer plans), and drop sync jobs (their clients went away with
        that process) and job folders without a record. A shared store: other servers' leases decide; only
        orphaned sync jobs and old record-less folders go."""
        if self.store.shared:
            for job_id in self.store.reap_orphaned_sync():
                self.files.remove(job_id)
            orphans = self.files.job_ids(older_than_s=ORPHAN_AGE_S) - self.store.ids()
        else:
            for job in self.store.sync_jobs():
                self.store.delete(job.id)
                self.files.remove(job.id)
            self.store.release_all()
            recovered = 0
            for job in self.store.unfinished():
                try:
                    self._plans[job.id] = plan_request(job.request, self.defaults, self.tasks)
                except (RequestError, MediaError) as e:  # the model or the input files changed under the job
                    self.store.update(job.id, status="failed", completed_at=int(self.clock()), error=_job_error(e))
                    continue
                self._done[job.id] = threading.Event()
                recovered += 1
            if recovered:
                log.info("recovered %d unfinished job(s)", recovered)
            orphans = self.files.job_ids() - self.store.ids()  # a crash between record and folder removal
        for orphan in orphans:
            self.files.remove(orphan)
        self.sweep_expired()

    def sweep_expired(self) -> int:
        """Delete the files of every job past its `expires_at`; the record stays, marked expired."""
        swept = 0
        for job in self.store.due_to_expire(int(self.clock())):
            with self._cond:
                if self._find_active(job.id) is not None:
                    continue
                self.store.update(job.id, expired=True)
            self.files.remove(job.id)
            swept += 1
        return swept

    def _sweep_forever(self) -> None:
        while not self._stop_background.wait(self.sweep_interval_s):
            try:
                self.sweep_expired()
            except Exception:
                log.exception("TTL sweep failed")


def _job_error(exc: BaseException) -> JobError:
    failure = job_error_for(exc)
    return JobError(failure.code, failure.message)
