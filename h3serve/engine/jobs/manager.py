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

Here: the manager and what the API asks of it (submit, delete, capacity, health). It owns its parts: one
`ReplicaRunner` per replica (runner.py), the `Outcomes` recorder (outcomes.py), the `LeaseKeeper` (leases.py),
the `Publisher` (publishing.py: outputs into the output store), the `Recovery` (recovery.py) and the replicas
real-time sessions hold (`SessionSlots`, sessions.py); their shared
state, under one lock, is its `JobBook` (book.py), and the settings they read its `JobPolicy` (types.py).
"""

from __future__ import annotations

import math
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import replace

from h3serve.engine.jobs.book import JobBook
from h3serve.engine.jobs.leases import LeaseKeeper
from h3serve.engine.jobs.outcomes import Outcomes
from h3serve.engine.jobs.publishing import Publisher
from h3serve.engine.jobs.recovery import Recovery
from h3serve.engine.jobs.replica_runner import ReplicaRunner
from h3serve.engine.jobs.sessions import SessionSlots
from h3serve.engine.jobs.shared_inputs import SharedInputs
from h3serve.engine.jobs.types import (
    ExecutorLike,
    JobListener,
    JobPolicy,
    QueueFull,
    ReplicaStatus,
    ShuttingDown,
    StartListener,
    UploadListener,
)
from h3serve.engine.planning import plan_request
from h3serve.engine.submission import Admission, PreparedJob, prepare_job
from h3serve.jobstore.job_files import JobFiles
from h3serve.jobstore.records import FINISHED, Job, new_job_id
from h3serve.jobstore.store import JobStore
from h3serve.media.mp4 import EncoderOptions
from h3serve.output_store.interface import OutputStore
from h3serve.output_store.local_folder import LocalFolderStore
from h3serve.rules.request import GenerationRequest
from h3serve.rules.validate import GenerationPlan, ModelDefaults

DEFAULT_RETRY_AFTER_S = 30
DEFAULT_LEASE_S = 30.0  # a dead server's job is claimed again this long after its last renewal
DEFAULT_POLL_S = 0.5  # idle runners look for work this often (a local submit wakes them at once)


def server_name() -> str:
    """A name no other live server has: host, pid and a random tag (a restarted process is a new owner)."""
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"


class JobManager:
    """Owns the runner threads (one per executor: the engine replicas), the lease heartbeat and the TTL sweeper.
    Jobs run in submission order; each replica runs one job at a time."""

    def __init__(
        self,
        executor: ExecutorLike | Sequence[ExecutorLike],
        store: JobStore,
        files: JobFiles,
        *,
        model_name: str,
        max_request_cost: float | None = None,
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
        outputs: OutputStore | None = None,
        upload_attempts: int = 5,
        upload_backoff_s: float = 1.0,
    ):
        self.executors: list[ExecutorLike] = list(executor) if isinstance(executor, Sequence) else [executor]
        if not self.executors:
            raise ValueError("a job manager needs at least one executor")
        self.store = store
        self.files = files
        self.outputs: OutputStore = outputs if outputs is not None else LocalFolderStore(files)
        self.admission = Admission(model_name, max_request_cost)
        self.max_queue = max_queue
        self.stall_timeout_s = stall_timeout_s
        self.policy = JobPolicy(
            owner=owner or server_name(),
            lease_s=lease_s,
            poll_s=poll_s,
            output_ttl_s=output_ttl_s or None,
            job_timeout_s=job_timeout_s,
            sweep_interval_s=sweep_interval_s,
            overlap_output=overlap_output,
            encoder_options=encoder_options,
            clock=clock,
            upload_attempts=upload_attempts,
            upload_backoff_s=upload_backoff_s,
            stage_manifest=self.outputs.remote,
        )
        self.book = JobBook(len(self.executors))
        self.outcomes = Outcomes(store, files, self.book, self.executors, self.policy)
        self.publisher = Publisher(store, files, self.outputs, self.book, self.outcomes, self.policy)
        self.inputs = SharedInputs(files, self.outputs, store.shared)
        self.runners = [
            ReplicaRunner(i, ex, store, self.publisher, self.inputs, self.book, self.outcomes, self.policy,
                          self._replan)
            for i, ex in enumerate(self.executors)
        ]
        self.leases = LeaseKeeper(store, self.publisher, self.book, self.outcomes, self.policy)
        self.recovery = Recovery(store, self.publisher, self.book, self.policy, self._replan)
        self.sessions = SessionSlots(self.book, self.executors, self._retry_after_s)  # real-time sessions' replicas
        self._runner_threads: list[threading.Thread] = []
        self._background: list[threading.Thread] = []

    # -- lifecycle -------------------------------------------------------------------------------------------

    @property
    def executor(self) -> ExecutorLike:
        """The first replica's executor (the only one without data parallelism)."""
        return self.executors[0]

    @property
    def owner(self) -> str:
        """This server's name in the store's leases."""
        return self.policy.owner

    @property
    def defaults(self) -> ModelDefaults:
        return self.executor.defaults

    @property
    def tasks(self) -> tuple[str, ...]:
        return self.executor.tasks

    def _replan(self, request: GenerationRequest) -> GenerationPlan:
        """A stored job's request planned again here (submitted to another server, or before a restart)."""
        return plan_request(request, self.defaults, self.tasks)

    def start(self) -> None:
        """Recover the stored jobs, then start the runners, the lease heartbeat and the TTL sweeper."""
        self.recovery.recover()
        self._runner_threads = [
            threading.Thread(target=runner.run_forever, name=f"h3serve-job-runner-{runner.replica}", daemon=True)
            for runner in self.runners
        ]
        self._background = [
            threading.Thread(target=self.leases.heartbeat_forever, name="h3serve-lease-heartbeat", daemon=True),
            threading.Thread(target=self.recovery.sweep_forever, name="h3serve-ttl-sweeper", daemon=True),
        ]
        for thread in (*self._runner_threads, *self._background):
            thread.start()

    def close(self, timeout_s: float = 30.0) -> None:
        """`stop`, then `join`: running jobs stop at their next step and go back to the queue."""
        self.stop()
        self.join(timeout_s)

    def stop(self) -> None:
        """Stop taking jobs, ask the running ones to stop and answer every waiter; returns at once. Idempotent.

        From here on a run that ends in `Cancelled` or `EngineError` (its ranks killed by `executor.close`)
        puts its job back in the queue instead of failing it. The waiters are answered now, not when their runs
        let go: a cancel lands only at the next step (up to `Executor.cancel_grace_s`), longer than the HTTP
        server waits for its requests before cancelling them. A waiter then finds its job unfinished."""
        with self.book.cond:
            self.stop_taking_work()
            for active in self.book.running():
                if active.seq is not None:
                    self.executors[active.replica].cancel(active.seq)
            self.answer_waiters()
        self.book.stop_background.set()

    def stop_taking_work(self) -> None:
        """The first step of every stop: no job is queued or claimed from here on (`ShuttingDown`). Idempotent."""
        self.book.stop()

    def answer_waiters(self, *, keep_held: bool = False) -> None:
        """Wake every waiter of this server's jobs (`done_event`), after `stop_taking_work` so that no new one
        comes. `keep_held`: not those of the jobs still held (running, or their output being written)."""
        self.book.answer_waiters(keep_held=keep_held)

    def drain(self, grace_s: float) -> bool:
        """Graceful stop, in order: take no more jobs, answer the waiters of queued jobs (they stay queued for
        the next start), give the running jobs `grace_s` to finish, then `stop` (cancelling them back into the
        queue and answering every remaining waiter). True if nothing was left running."""
        deadline = time.monotonic() + grace_s
        self.stop_taking_work()
        self.answer_waiters(keep_held=True)
        with self.book.cond:
            while self.book.held() and (left := deadline - time.monotonic()) > 0:
                self.book.cond.wait(left)
            finished = not self.book.held()
        self.stop()
        return finished

    def join(self, timeout_s: float = 30.0) -> bool:
        """Wait for every thread to exit and the uploads in flight to end; True once all have (the store may then
        be closed). An upload still going is left: its job is published again on the next start."""
        deadline = time.monotonic() + timeout_s
        threads = (*self._runner_threads, *self._background)
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        uploaded = self.publisher.join(deadline - time.monotonic())
        if uploaded:
            self.publisher.close()
        return uploaded and not any(t.is_alive() for t in threads)

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
        active = self.book.running_on(i)
        problem = None
        if len(self._runner_threads) <= i or not self._runner_threads[i].is_alive():
            problem = "the job runner is not running"
        elif not self.executors[i].alive():
            problem = "the engine's rank processes are not running"
        elif active is not None and self.stall_timeout_s is not None:
            stalled_s = time.monotonic() - active.last_progress
            if stalled_s > self.stall_timeout_s:
                limit = self.stall_timeout_s
                problem = f"the running job made no progress for {stalled_s:.0f} s (--stall-timeout {limit:g})"
        job_id = active.job_id if active else None
        busy = active is not None or self.book.in_session(i)
        return ReplicaStatus(i, busy, job_id, self.book.served(i), problem, self.book.counters(i))

    def add_listener(self, listener: JobListener) -> None:
        """`listener(job)` is called from a runner thread whenever a job completes or fails."""
        self.book.listeners.append(listener)

    def add_start_listener(self, listener: StartListener) -> None:
        """`listener(replica, queue_wait_s)` is called from a runner thread whenever it takes a job."""
        self.book.start_listeners.append(listener)

    def add_upload_listener(self, listener: UploadListener) -> None:
        """`listener(outcome, bytes, seconds)` is called from an upload thread for every file put into a bucket
        ("uploaded") and every failed attempt at a job's files ("retried", or "failed": the job failed)."""
        self.book.upload_listeners.append(listener)

    # -- requests from the API -------------------------------------------------------------------------------

    @property
    def queue_depth(self) -> int:
        return self.store.count_queued()

    def check_capacity(self) -> None:
        """Raise `QueueFull` now, before a request spends time on uploads and downloads."""
        with self.book.cond:
            self._check_capacity()

    def _check_capacity(self, outputs: int = 1) -> None:
        """Room for a job of `outputs` outputs: the queue counts outputs, and an empty queue takes any one job
        (else a job of more outputs than `--max-queue` could never run)."""
        if self.book.stopping:
            raise ShuttingDown("the server is shutting down")
        depth = self.store.count_queued()  # every server's queued outputs, on a shared store
        if depth >= self.max_queue or (depth > 0 and depth + outputs > self.max_queue):
            raise QueueFull(depth, self._retry_after_s())

    def _retry_after_s(self) -> int:
        """A slot frees when a running job ends: about one job's duration, from the recent ones."""
        recent = self.book.recent_run_seconds()
        if not recent:
            return DEFAULT_RETRY_AFTER_S
        return max(1, math.ceil(sum(recent) / len(recent) / len(self.executors)))

    def submit(
        self, request: GenerationRequest, *, job_id: str | None = None, seconds: str | None = None, sync: bool = False,
        key_scope: str = "",
    ) -> Job:
        """Plan, admit and record `request`, then queue it (`prepare`, then `enqueue`). `seconds`: the job's
        `seconds` as the client asked (None: the planned duration); `key_scope`: the API key that asked."""
        return self.enqueue(self.prepare(request, job_id=job_id, seconds=seconds, sync=sync, key_scope=key_scope))

    def prepare(
        self, request: GenerationRequest, *, job_id: str | None = None, seconds: str | None = None, sync: bool = False,
        key_scope: str = "",
    ) -> PreparedJob:
        """The job `request` becomes: planned (`RequestError` / `MediaError` naming the field), admitted by cost
        (`TooCostly`) and recorded, not yet queued. A sync request prepares once and may then wait for a slot."""
        return prepare_job(request, self.defaults, self.tasks, self.admission, job_id=job_id or new_job_id(),
                           created_at=int(self.policy.clock()), seconds=seconds, sync=sync, key_scope=key_scope)

    def enqueue(self, prepared: PreparedJob) -> Job:
        """Store the prepared job in the queue behind the others. Raises `QueueFull` or `ShuttingDown`.

        A sync job is leased to this server from the start: only it may run the job (its HTTP client waits
        here), and if this server dies the lease runs out and any server deletes the job. On a shared queue
        whose outputs go to a bucket, the job's input files go there first (`OutputStoreUnavailable` if they
        cannot), so that any server can run it."""
        job = prepared.job
        with self.book.cond:
            self._check_capacity(job.num_outputs)
        self.inputs.share(job)  # outside the lock: uploads take time
        try:
            with self.book.cond:
                self._check_capacity(job.num_outputs)
                if job.sync:
                    job = replace(job, owner=self.policy.owner, lease_expires_at=time.time() + self.policy.lease_s)
                job = self.store.insert(job)
                self.book.track(job.id, prepared.plan)
        except BaseException:
            if self.inputs.active and not job.sync:
                self.inputs.unshare(job.id)
            raise
        return job

    def done_event(self, job_id: str) -> threading.Event | None:
        """Set once the job completes, fails or is deleted; None when this server is not tracking it.

        Lock-free (one dict read), so the event loop can call it without waiting on a store write."""
        return self.book.waiter(job_id)

    def delete(self, job_id: str) -> bool:
        """Forget a job and its files. A queued job leaves the queue; a running one stops at its next step
        (on another server: once that server's lease renewal finds the record gone). A finished job's objects
        leave a bucket before its record does: `OutputStoreUnavailable` (the job kept) when they cannot."""
        finished = self.store.get(job_id)
        if finished is not None and finished.status in FINISHED and not finished.expired:
            self.publisher.remove_published(job_id)
        with self.book.cond:
            job = self.store.get(job_id)
            if job is None or not self.store.delete(job_id):
                return False
            active = self.book.find(job_id)
            if active is not None:
                self.book.dropped(active, deleted=True)  # the runner removes the files once the executor lets go
                if active.seq is not None:
                    self.executors[active.replica].cancel(active.seq)
                return True
            self.book.forget(job_id)
        running_elsewhere = (job.status == "in_progress" and job.owner != self.policy.owner
                             and (job.lease_expires_at or 0) > time.time())
        if not running_elsewhere:  # else its owner removes them once it lets go (it may be writing them)
            self.publisher.forget(job_id)
        return True

    # -- leases and expiry -------------------------------------------------------------------------------------

    def heartbeat(self) -> None:
        """Renew this server's leases now (the heartbeat thread does so every third of a lease)."""
        self.leases.renew()

    def sweep_expired(self) -> int:
        """Delete the files of every job past its `expires_at` now (the sweeper does so periodically)."""
        return self.recovery.sweep_expired()
