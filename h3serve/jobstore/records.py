"""The job record and its statuses: the one definition every layer (store, engine, API, metrics) reads."""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import Literal, get_args

from h3serve.rules import limits
from h3serve.rules.request import GenerationRequest
from h3serve.rules.validate import GenerationPlan

JobStatus = Literal["queued", "in_progress", "completed", "failed"]
JOB_STATUSES: tuple[JobStatus, ...] = get_args(JobStatus)
UNFINISHED: tuple[JobStatus, ...] = ("queued", "in_progress")
FINISHED: tuple[JobStatus, ...] = ("completed", "failed")

# Codes of failures the request itself caused (its fields or media failed a check at run time): a client
# error, not a server one. Every other code (generation_failed, output_failed, internal_error) is the server's.
CLIENT_ERROR_CODES = frozenset({"invalid_request", "invalid_media"})


def new_job_id() -> str:
    return f"video_{secrets.token_hex(16)}"


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
    """One video job as stored. `seq` (assigned by the store) is the FIFO order; `sync` jobs are never listed.

    `owner` and `lease_expires_at` (seconds since the epoch) name the server holding the job: the one running
    it, or for a sync job the one whose HTTP client waits for it. `completions` counts recorded completions
    (exactly one for a finished job: the check that a job was never recorded twice)."""

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
    owner: str | None = None
    lease_expires_at: float | None = None
    completions: int = 0
    progress_steps: int = 0  # forwards `progress` counts (steps x generated windows x outputs); 0: not recorded
    num_outputs: int = 1  # outputs of the prompt (num_outputs_per_prompt): what the job counts toward the queue bound
    key_scope: str = ""  # which API key made it (a digest, "" with keys off): its webhook endpoints get its event
    # Every run of every stage: (stage, start, end) in seconds since the job's run began, in start order; stages
    # that ran beside each other (the MP4 encode and the video decode) overlap. Empty: not recorded.
    stage_timeline: tuple[tuple[str, float, float], ...] = ()
    seq: int = 0

    @classmethod
    def planned(cls, job_id: str, model: str, request: GenerationRequest, plan: GenerationPlan, seconds: str,
                created_at: int, sync: bool = False, key_scope: str = "") -> Job:
        return cls(
            id=job_id, model=model, request=request, created_at=created_at, size=f"{plan.width}x{plan.height}",
            seconds=seconds, num_frames=plan.num_frames, fps=limits.FPS, duration_s=plan.duration_s, sync=sync,
            progress_steps=plan.progress_forwards, num_outputs=plan.num_outputs, key_scope=key_scope,
        )
