"""The one owner of a job manager's state: which replica runs or finishes which job, the replicas its real-time
sessions hold, the plans, the waiters of its jobs and its counters.

The runner threads, the finishers, the lease heartbeat and the API threads all meet here, and every change is one
of `JobBook`'s methods, each taking its lock (`cond`, re-entrant: a caller may already hold it to combine a change
with a store write). No other class writes its fields; its invariants (tests/engine/test_job_book.py) hold because
these methods are the only way in:
- a job is held by at most one replica, and in one state there: running (`active`), finishing (its output being
  written while the runner takes the next job) or uploading (its files going to the output store's bucket, the
  replica free);
- a replica runs at most one job and finishes at most one, and a real-time session holds only a replica that runs
  nothing;
- a dropped job (deleted, or claimed by another server) never starts: its run is cancelled at once;
- a job leaves the book once, releasing its waiters and counting towards its replica's jobs served.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from h3serve.engine.jobs.types import JobListener, StartListener, UploadListener
from h3serve.errors import ServerError
from h3serve.media.mp4 import EncoderOptions
from h3serve.rules.validate import GenerationPlan

RECENT_RUNS = 8  # run times kept for the Retry-After estimate


class JobStateError(ServerError, RuntimeError):
    """A change the book's invariants forbid (a bug in the caller, never a client's error)."""

    code = "job_state_error"


@dataclass
class ActiveJob:
    """A job a replica holds. `seq` is the executor's handle, known once the executor has taken the job. Its
    fields change only through `JobBook`."""

    job_id: str
    replica: int
    seq: int | None = None
    deleted: bool = False
    lost: bool = False  # another server holds the job now (this one's lease ran out): its result is not ours
    started: float = field(default_factory=time.monotonic)
    encoder: EncoderOptions | None = None  # the MP4 settings of its run: the server's with the request's own
    last_progress: float = field(default_factory=time.monotonic)  # /health's stall check

    @property
    def dropped(self) -> bool:
        return self.deleted or self.lost


class JobBook:
    """The manager's shared state, changed only by these methods (under `cond`). The listeners are added before
    the manager starts."""

    def __init__(self, replicas: int):
        self.cond = threading.Condition()  # re-entrant: methods take it even when the caller holds it
        self.stop_background = threading.Event()  # ends the heartbeat and the TTL sweeper
        self.listeners: list[JobListener] = []
        self.start_listeners: list[StartListener] = []
        self.upload_listeners: list[UploadListener] = []
        self._replicas = replicas
        self._stopping = False
        self._wakeups = 0  # bumped on every local submit: a runner that saw no job re-checks before waiting
        self._plans: dict[str, GenerationPlan] = {}  # plans of jobs planned here (a claim elsewhere re-plans)
        self._active: dict[int, ActiveJob] = {}  # replica -> the job it runs
        self._finishing: dict[int, ActiveJob] = {}  # replica -> its job whose output is being written
        self._finishers: dict[int, threading.Thread] = {}  # replica -> the thread writing it
        self._uploading: dict[str, ActiveJob] = {}  # job id -> a job whose files go up to the bucket
        self._sessions: set[int] = set()  # replicas held by a real-time session (their runners claim no job)
        self._served = [0] * replicas
        self._counters: list[dict[str, int]] = [{} for _ in range(replicas)]  # as of each replica's last output
        self._done: dict[str, threading.Event] = {}  # set once the job completes, fails or is deleted
        self._run_seconds: list[float] = []  # the recent jobs' run times (Retry-After)

    # -- reading -----------------------------------------------------------------------------------------------

    @property
    def stopping(self) -> bool:
        return self._stopping

    @property
    def wakeups(self) -> int:
        return self._wakeups

    def held(self) -> list[ActiveJob]:
        """Every job this server holds: running on a replica, having its output written, or uploaded."""
        with self.cond:
            return [*self._active.values(), *self._finishing.values(), *self._uploading.values()]

    def uploads(self) -> list[ActiveJob]:
        """The jobs whose files go up to the bucket now."""
        with self.cond:
            return list(self._uploading.values())

    def find(self, job_id: str) -> ActiveJob | None:
        return next((a for a in self.held() if a.job_id == job_id), None)

    def running_on(self, replica: int) -> ActiveJob | None:
        return self._active.get(replica)

    def running(self) -> list[ActiveJob]:
        with self.cond:
            return list(self._active.values())

    def in_session(self, replica: int) -> bool:
        return replica in self._sessions

    def finisher_of(self, replica: int) -> threading.Thread | None:
        return self._finishers.get(replica)

    def plan_of(self, job_id: str) -> GenerationPlan | None:
        return self._plans.get(job_id)

    def waiter(self, job_id: str) -> threading.Event | None:
        """Set once the job completes, fails or is deleted; None when this server is not tracking it. Lock-free
        (one dict read), so the event loop can call it without waiting on a store write."""
        return self._done.get(job_id)

    def tracked(self) -> set[str]:
        """The jobs this server has a plan or a waiter for."""
        with self.cond:
            return set(self._done) | set(self._plans)

    def waited_on(self) -> set[str]:
        with self.cond:
            return set(self._done)

    def served(self, replica: int) -> int:
        return self._served[replica]

    def counters(self, replica: int) -> dict[str, int]:
        return dict(self._counters[replica])

    def recent_run_seconds(self) -> list[float]:
        with self.cond:
            return list(self._run_seconds)

    # -- jobs coming in ----------------------------------------------------------------------------------------

    def track(self, job_id: str, plan: GenerationPlan, *, wake: bool = True) -> None:
        """A job queued here (or recovered at start-up): its plan and its waiter; `wake` the idle runners."""
        with self.cond:
            self._plans[job_id] = plan
            self._done[job_id] = threading.Event()
            if wake:
                self._wakeups += 1
                self.cond.notify_all()

    def forget(self, job_id: str) -> None:
        """A job this server no longer tracks (deleted while queued, or finished elsewhere): answer its waiters."""
        with self.cond:
            self._plans.pop(job_id, None)
            self._finish_waiters(job_id)

    # -- a replica's job, from claim to release ----------------------------------------------------------------

    def claim(self, replica: int, job_id: str) -> ActiveJob:
        """`replica` starts running `job_id` (claimed from the store under this server's lease)."""
        with self.cond:
            if replica in self._active:
                raise JobStateError(f"replica {replica} already runs job {self._active[replica].job_id}")
            if replica in self._sessions:
                raise JobStateError(f"replica {replica} is held by a real-time session")
            if self.find(job_id) is not None:
                raise JobStateError(f"job {job_id} is already held here")
            active = self._active[replica] = ActiveJob(job_id, replica)
            return active

    def started(self, active: ActiveJob, seq: int) -> bool:
        """The executor took the job as run `seq`. True when the run must be cancelled at once: the job was
        dropped meanwhile, or the manager is stopping."""
        with self.cond:
            active.seq = seq
            active.last_progress = time.monotonic()
            return active.dropped or self._stopping

    def progressed(self, active: ActiveJob) -> None:
        """The run made a step (the stall check reads it); lock-free, a float store."""
        active.last_progress = time.monotonic()

    def dropped(self, active: ActiveJob, *, deleted: bool) -> None:
        """This server no longer holds the job: `deleted`, or claimed elsewhere after this server's lease ran out
        (lost). Its run is cancelled by the caller (`active.seq`); its output is never recorded."""
        with self.cond:
            if deleted:
                active.deleted = True
            else:
                active.lost = True

    def hand_off(self, replica: int, active: ActiveJob, finisher: threading.Thread) -> None:
        """The run ended: the job's output is written by `finisher` while the replica takes its next job."""
        with self.cond:
            if self._active.get(replica) is not active:
                raise JobStateError(f"job {active.job_id} is not running on replica {replica}")
            if replica in self._finishing:
                raise JobStateError(f"replica {replica} is still finishing job {self._finishing[replica].job_id}")
            del self._active[replica]
            self._finishing[replica] = active
            self._finishers[replica] = finisher

    def uploading(self, active: ActiveJob) -> None:
        """The job's files are written: they go up to the bucket on the upload pool, its replica free (running the
        next job, finishing nothing). The job stays held: its lease is renewed, a drain waits for it."""
        with self.cond:
            replica = active.replica
            if self._active.get(replica) is active:
                del self._active[replica]
            elif self._finishing.get(replica) is active:
                del self._finishing[replica]
            else:
                raise JobStateError(f"job {active.job_id} is not held by replica {replica}")
            self._uploading[active.job_id] = active
            self.cond.notify_all()

    def release(self, replica: int, active: ActiveJob) -> None:
        """The job leaves this server's hands (its outcome is stored, or it went back to the queue): count it and
        wake its waiters, and a drain that waits for the held jobs."""
        with self.cond:
            if self._active.get(replica) is active:
                del self._active[replica]
            elif self._finishing.get(replica) is active:
                del self._finishing[replica]
            elif self._uploading.get(active.job_id) is active:
                del self._uploading[active.job_id]
            else:
                raise JobStateError(f"job {active.job_id} is not held by replica {replica}")
            self._served[replica] += 1
            self._plans.pop(active.job_id, None)
            self._finish_waiters(active.job_id)  # after the outcome is stored: a sync waiter reads it next
            self.cond.notify_all()

    def record_run(self, seconds: float) -> None:
        with self.cond:
            self._run_seconds = [*self._run_seconds[-(RECENT_RUNS - 1):], seconds]

    def record_counters(self, replica: int, counters: dict[str, int]) -> None:
        with self.cond:
            self._counters[replica] = dict(counters)

    # -- real-time sessions ------------------------------------------------------------------------------------

    def reserve_session(self) -> int | None:
        """A replica that runs no job and no session, held by a session from now on; None when there is none."""
        with self.cond:
            for replica in range(self._replicas):
                if replica not in self._active and replica not in self._sessions:
                    self._sessions.add(replica)
                    return replica
            return None

    def release_session(self, replica: int) -> None:
        with self.cond:
            self._sessions.discard(replica)
            self.cond.notify_all()  # the replica's runner may claim again

    # -- stopping ----------------------------------------------------------------------------------------------

    def stop(self) -> None:
        """No job is queued or claimed from here on. Idempotent."""
        with self.cond:
            self._stopping = True
            self.cond.notify_all()

    def answer_waiters(self, *, keep_held: bool = False) -> None:
        """Wake every waiter of this server's jobs; `keep_held`: not those of the jobs still held."""
        with self.cond:
            held = {a.job_id for a in self.held()} if keep_held else set()
            for job_id in [j for j in self._done if j not in held]:
                self._finish_waiters(job_id)
            self.cond.notify_all()

    def _finish_waiters(self, job_id: str) -> None:
        event = self._done.pop(job_id, None)
        if event is not None:
            event.set()
