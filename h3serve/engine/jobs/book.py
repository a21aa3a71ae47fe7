"""What a job manager holds, under its one lock: the jobs its replicas run or finish, the replicas its real-time
sessions hold, the plans, the waiters of its jobs and its counters. The runner threads, the finishers, the lease
heartbeat and the API threads all meet here (h3serve.engine.jobs)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from h3serve.engine.jobs.types import JobListener, StartListener
from h3serve.media.mp4 import EncoderOptions
from h3serve.rules.validate import GenerationPlan


@dataclass
class ActiveJob:
    """A job a replica holds. `seq` is the executor's handle, known once the executor has taken the job."""

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
    """The manager's shared state. The mutable fields are read and written under `cond`; the listeners are added
    before the manager starts."""

    def __init__(self, replicas: int):
        self.cond = threading.Condition()
        self.stopping = False
        self.stop_background = threading.Event()  # ends the heartbeat and the TTL sweeper
        self.wakeups = 0  # bumped on every local submit: a runner that saw no job re-checks before waiting
        self.plans: dict[str, GenerationPlan] = {}  # plans of jobs planned here (a claim elsewhere re-plans)
        self.active: dict[int, ActiveJob] = {}  # replica -> the job it runs
        self.finishing: dict[int, ActiveJob] = {}  # replica -> its job whose output is being written
        self.finishers: dict[int, threading.Thread] = {}  # replica -> the thread writing it
        self.sessions: set[int] = set()  # replicas held by a real-time session (their runners claim no job)
        self.served = [0] * replicas
        self.counters: list[dict[str, int]] = [{} for _ in range(replicas)]  # as of each replica's last output
        self.done: dict[str, threading.Event] = {}  # set once the job completes, fails or is deleted
        self.run_seconds: list[float] = []  # the recent jobs' run times (Retry-After)
        self.listeners: list[JobListener] = []
        self.start_listeners: list[StartListener] = []

    def held(self) -> list[ActiveJob]:
        """Every job this server holds: running on a replica, or having its output written."""
        return [*self.active.values(), *self.finishing.values()]

    def find(self, job_id: str) -> ActiveJob | None:
        return next((a for a in self.held() if a.job_id == job_id), None)

    def finish_waiters(self, job_id: str) -> None:
        event = self.done.pop(job_id, None)
        if event is not None:
            event.set()
