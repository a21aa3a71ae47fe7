"""Response bodies: OpenAI's Video object (plus h3serve's measurements), lists, deletions, errors, models."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel

from h3serve.jobstore.records import Job, JobStatus


def _text(value: str) -> str:
    """Text that serialises as UTF-8: a lone surrogate stored before requests were checked for them becomes '?'
    rather than failing every response that holds it."""
    return value.encode("utf-8", "replace").decode("utf-8")


class VideoError(BaseModel):
    code: str
    message: str


class VideoOutput(BaseModel):
    """One output of a job (num_outputs_per_prompt): output `index` is the request at seed + index."""

    index: int
    url: str  # where its MP4 downloads (add &variant=thumbnail|spritesheet for its previews)


class StageSpan(BaseModel):
    """One run of a stage: seconds since the job's run began (stages that ran beside each other overlap)."""

    stage: str
    start_s: float
    end_s: float


class Video(BaseModel):
    """OpenAI's `Video` with every field always present, plus num_frames, fps, duration_s and measurements."""

    id: str
    object: Literal["video"] = "video"
    model: str
    status: JobStatus
    progress: int
    progress_steps: int  # h3serve: the denoiser forwards `progress` counts (steps x generated windows); 0: unknown
    created_at: int
    completed_at: int | None
    expires_at: int | None
    prompt: str
    size: str
    seconds: str
    remixed_from_video_id: str | None = None
    error: VideoError | None
    num_frames: int
    fps: int
    duration_s: float
    stage_durations: dict[str, float]
    stage_timeline: list[StageSpan]  # h3serve: each stage's start and end, in start order (empty until done)
    peak_memory_mb: float
    inference_time_s: float | None
    num_outputs: int  # h3serve: outputs of the prompt (num_outputs_per_prompt)
    outputs: list[VideoOutput]  # h3serve: every output, by index (one for a single-output job)

    @classmethod
    def from_job(cls, job: Job) -> Video:
        return cls(
            id=job.id,
            model=_text(job.model),
            status=job.status,
            progress=job.progress,
            progress_steps=job.progress_steps,
            created_at=job.created_at,
            completed_at=job.completed_at,
            expires_at=job.expires_at,
            prompt=_text(job.request.prompt),
            size=_text(job.size),
            seconds=_text(job.seconds),
            remixed_from_video_id=job.request.remixed_from_video_id,
            error=None if job.error is None else VideoError(code=job.error.code, message=_text(job.error.message)),
            num_frames=job.num_frames,
            fps=job.fps,
            duration_s=round(job.duration_s, 6),
            stage_durations={k: round(v, 6) for k, v in job.stage_durations.items()},
            stage_timeline=[StageSpan(stage=name, start_s=round(start, 6), end_s=round(end, 6))
                            for name, start, end in job.stage_timeline],
            peak_memory_mb=round(job.peak_memory_mb, 3),
            inference_time_s=None if job.inference_time_s is None else round(job.inference_time_s, 3),
            num_outputs=job.num_outputs,
            outputs=[VideoOutput(index=i, url=f"/v1/videos/{job.id}/content?index={i}")
                     for i in range(job.num_outputs)],
        )


class VideoList(BaseModel):
    object: Literal["list"] = "list"
    data: list[Video]
    first_id: str | None
    last_id: str | None
    has_more: bool


class VideoDeleted(BaseModel):
    id: str
    object: Literal["video.deleted"] = "video.deleted"
    deleted: bool = True


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str


class ErrorBody(BaseModel):
    error: ErrorDetail


class Model(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "h3serve"
    # A LoRA adapter's card, as vLLM lists LoRA modules: its file, the base model, and its factors.
    root: str | None = None
    parent: str | None = None
    permission: list[dict[str, Any]] | None = None
    lora: dict[str, Any] | None = None
    turbo: dict[str, Any] | None = None  # a Turbo adapter's contract: its forwards and tasks
    pdd: dict[str, Any] | None = None  # a PDD 8-step adapter's: its forwards and tasks
    flashgen: dict[str, Any] | None = None  # a FlashGen 4-step LoRA's: its forwards, tasks and base schedule
    # The served model's card only: what the engine serves and how (h3serve.api.model_card).
    capabilities: dict[str, Any] | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[Model]
