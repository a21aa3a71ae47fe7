"""Typed messages between the executor (parent) and its rank processes, and what a run hands back
(`GenerationOutput`): the leaf both sides import, so that neither imports the other.

Parent -> rank 0: `RankJob`, `RealtimeOpen` (then, while the session runs, `RealtimeInteract`, `RealtimeRead` and
`RealtimeStop`), or `Stop`. Rank 0 -> parent: every other class here. All are picklable frozen dataclasses; `seq`
ties a message to the job or session it is about.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from h3serve.media.mp4 import EncoderOptions
from h3serve.rules.validate import GenerationPlan, ModelDefaults
from h3serve.rules.validate.realtime_plan import RealtimePlan


@dataclass(frozen=True)
class RankJob:
    """What travels from the parent to rank 0 (and from rank 0 to every rank)."""

    seq: int
    plan: GenerationPlan
    spool: str  # file rank 0 writes the result arrays into (`--decode-mode full`, or no `encoder`)
    encoder: EncoderOptions | None = None  # streamed (`--decode-mode stream`): rank 0 writes the MP4 itself

    def spool_for(self, index: int) -> str:
        """The spool file of output `index` of several (output 0's is `spool`)."""
        return spool_file(self.spool, index)


def spool_file(spool: str, index: int) -> str:
    """`job.npz`, `job.1.npz`, ...: where rank 0 spools output `index`'s arrays."""
    if index == 0:
        return spool
    stem, dot, suffix = spool.rpartition(".")
    return f"{stem}.{index}.{suffix}" if dot else f"{spool}.{index}"


@dataclass(frozen=True)
class RealtimeOpen:
    """Start a real-time session (every rank runs it); its chunks' media go to files in `spool_dir`."""

    seq: int
    plan: RealtimePlan
    spool_dir: str


@dataclass(frozen=True)
class RealtimeInteract:
    """A new prompt for session `seq`, from its next chunk boundary on."""

    seq: int
    prompt: str
    event_id: str


@dataclass(frozen=True)
class RealtimeRead:
    """The parent took chunk `index` of session `seq` (the ranks stay at most `CHUNKS_AHEAD` chunks ahead)."""

    seq: int
    index: int


@dataclass(frozen=True)
class RealtimeStop:
    """End session `seq` after the chunk in flight."""

    seq: int


@dataclass(frozen=True)
class RealtimeChunkReady:
    """A chunk of session `seq` is generated: its frames and audio are in `path` (h3serve.media.raw.read_chunk)."""

    seq: int
    index: int
    path: str
    frames: int
    audio_samples: int
    started_event_ids: tuple[str, ...] = ()
    active_event_ids: tuple[str, ...] = ()
    completed_event_ids: tuple[str, ...] = ()


@dataclass(frozen=True)
class RealtimeEnded:
    """Session `seq` generated its last chunk (`stopped`: it ended early, on `RealtimeStop`)."""

    seq: int
    chunks: int
    stopped: bool


@dataclass(frozen=True)
class Stop:
    """Exit cleanly (the executor is closing)."""


@dataclass(frozen=True)
class Ready:
    defaults: ModelDefaults
    tasks: tuple[str, ...]


@dataclass(frozen=True)
class Fatal:
    """Start-up failed; `message` says why. `config_error`: a flag the rank's start-up check refused (the
    parent raises it as that `ConfigError`)."""

    message: str
    config_error: bool = False


@dataclass(frozen=True)
class JobProgress:
    seq: int
    done: int
    total: int


@dataclass(frozen=True)
class Done:
    """The result arrays are in the job's spool files (one per output), or (streamed) the files named in `files`
    are written."""

    seq: int
    stage_durations: dict[str, float]
    peak_memory_mb: float
    files: tuple[dict[str, str], ...] | None = None  # streamed: per output, download variant -> path (MP4, previews)
    frames: int = 0  # streamed: frames in each MP4
    outputs: int = 1  # spooled: outputs, output i in `RankJob.spool_for(i)`
    counters: dict[str, int] | None = None  # rank 0's running totals (ModelRunner.counters)
    stage_timeline: tuple[tuple[str, float, float], ...] = ()  # (stage, start, end) on the time.monotonic clock


@dataclass(frozen=True)
class JobCancelled:
    seq: int


@dataclass(frozen=True)
class JobFailed:
    """A rank raised. `rank` is set when the rank exits after reporting (several ranks); `client_error` when the
    request itself was at fault, and `code` its job error code (h3serve.errors.job_error_for)."""

    seq: int
    message: str
    rank: int | None
    client_error: bool
    code: str = "invalid_request"


Event = Ready | Fatal | JobProgress | Done | JobCancelled | JobFailed | RealtimeChunkReady | RealtimeEnded


@dataclass
class GenerationOutput:
    """The decoded arrays (`--decode-mode full`), or, streamed, the files the engine wrote (by download variant:
    video, thumbnail, spritesheet), and the soundtrack either way."""

    video: np.ndarray | None  # [T, H, W, 3] float32 in [0, 1]; None when streamed into files
    audio: np.ndarray | None  # [2, N] float32 in [-1, 1] at 32 kHz; None when streamed by rank processes
    stage_durations: dict[str, float] = field(default_factory=dict)
    # Every run of every stage, (stage, start, end) on the time.monotonic clock (one clock for the host's processes),
    # in start order: the stages that ran beside each other (the MP4 encode and the video decode) overlap.
    stage_timeline: list[tuple[str, float, float]] = field(default_factory=list)
    peak_memory_mb: float = 0.0
    files: dict[str, str] = field(default_factory=dict)  # streamed: variant -> path of the file written
    streamed_frames: int = 0  # streamed: frames in the MP4
    # The engine's running totals (ModelRunner.counters), and from the executor "engine_loads": model loads.
    counters: dict[str, int] = field(default_factory=dict)
    # Several outputs of one prompt: outputs 1..N-1, each its own media (the measurements above are the run's).
    others: list[GenerationOutput] = field(default_factory=list)

    @property
    def outputs(self) -> list[GenerationOutput]:
        """Every output in index order: this one (output 0), then the others."""
        return [self, *self.others]

    @property
    def num_frames(self) -> int:
        return self.streamed_frames if self.video is None else int(self.video.shape[0])
