"""The job manager's leaf types: the errors it raises at submission, the executor it drives, what it reports, and
the settings its parts share.

Kept apart from the manager so that the HTTP layer can name the errors without the manager's machinery.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from h3serve.engine.realtime_stream import RealtimeSpec, RealtimeStream
from h3serve.errors import ServerError
from h3serve.jobstore.records import Job
from h3serve.media.mp4 import EncoderOptions
from h3serve.messages import GenerationOutput
from h3serve.rules.request import GenerationRequest
from h3serve.rules.validate import GenerationPlan, ModelDefaults


class ExecutorLike(Protocol):
    """What the manager needs from `h3serve.engine.executor.Executor`."""

    defaults: ModelDefaults
    tasks: tuple[str, ...]  # what the loaded DiTs serve

    def generate(self, plan: GenerationPlan, on_progress: Callable[[int, int], None] | None = None,
                 on_start: Callable[[int], None] | None = None, timeout_s: float | None = None,
                 encoder: EncoderOptions | None = None) -> GenerationOutput: ...
    def cancel(self, seq: int) -> None: ...
    def alive(self) -> bool: ...
    def open_realtime(self, spec: RealtimeSpec) -> RealtimeStream: ...


class QueueFull(ServerError, RuntimeError):
    """The queue holds `max_queue` outputs already (a job of N outputs counts N); try again after `retry_after_s`."""

    code = "queue_full"

    def __init__(self, depth: int, retry_after_s: int):
        super().__init__(f"the queue is full ({depth} outputs waiting); retry in about {retry_after_s} s")
        self.depth = depth
        self.retry_after_s = retry_after_s


class ShuttingDown(ServerError, RuntimeError):
    """The manager is closing and takes no new jobs."""

    code = "shutting_down"


@dataclass(frozen=True)
class ReplicaStatus:
    """One engine replica as /health and /metrics show it."""

    index: int
    busy: bool  # running a job or holding a real-time session
    job_id: str | None
    jobs_served: int
    problem: str | None  # why it cannot serve; None: it can
    counters: dict[str, int] = field(default_factory=dict)  # the engine's totals as of its last output (/metrics)


JobListener = Callable[[Job], None]
StartListener = Callable[[int, float], None]  # (replica, seconds the job waited in the queue)
# (outcome, bytes, seconds) per file put into a bucket: "uploaded", or a failed attempt "retried" / "failed" (0, 0).
UploadListener = Callable[[str, int, float], None]
Replanner = Callable[[GenerationRequest], GenerationPlan]  # a stored job's request planned again on this server


@dataclass(frozen=True)
class JobPolicy:
    """The manager's settings that its runners, outcome recorder, lease keeper and recovery read."""

    owner: str  # this server's name in the store's leases
    lease_s: float
    poll_s: float
    output_ttl_s: float | None
    job_timeout_s: float | None
    sweep_interval_s: float
    overlap_output: bool
    encoder_options: EncoderOptions
    clock: Callable[[], float]
    upload_attempts: int = 5  # tries at putting a job's outputs into a bucket before the job fails
    upload_backoff_s: float = 1.0  # the wait after the first failed try; doubled after each (at most 30 s)
    stage_manifest: bool = False  # outputs go up to a bucket: a staged job's manifest lets a restart publish it
