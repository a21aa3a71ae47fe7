"""What validation produces: the `GenerationPlan` (it reads the checkpoint's `ModelDefaults`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from h3serve.rules import geometry, limits
from h3serve.rules.adapter_choice import AdapterChoice
from h3serve.rules.cache_refresh import ForceRefresh
from h3serve.rules.edit_mask import LatentMask
from h3serve.rules.guides import PlacedGuide
from h3serve.rules.long_video import Window
from h3serve.rules.names import DEFAULT_SAMPLE_SOLVER, SampleSolver
from h3serve.rules.request import ControlRequest, MediaRef


@dataclass(frozen=True)
class GenerationPlan:
    """A validated request with every default resolved: exactly what the pipeline runs."""

    prompt: str
    width: int
    height: int
    num_frames: int  # 17n + 5
    steps: int  # denoiser forwards (N + 1 sigma points)
    seed: int
    flow_shift: float
    audio_flow_shift: float
    task: str = "t2va"
    image: MediaRef | None = None
    last_image: MediaRef | None = None
    references: tuple[MediaRef, ...] = ()
    quality: str | None = None  # DiT block cache policy (h3serve.accel.cache.profile_for)
    long_video_mode: str | None = None  # None (<= 15 s), full (one pass) or continuation (windows)
    windows: tuple[Window, ...] = ()  # continuation: the windows, in order
    window_prompts: tuple[str, ...] = ()  # continuation: the text each window's encoder reads
    # Latent-mask editing: the sources and the canonical masks (video (T, H, W), audio (2, A); 1 = generate).
    source_video: MediaRef | None = None
    source_audio: MediaRef | None = None  # an edit's audio source, or lock_source's driving audio
    video_mask: LatentMask | None = None
    audio_mask: LatentMask | None = None
    audio_mode: str = "native"
    extend_video: MediaRef | None = None  # an extension's source: window 0 (windows[0].end frames) is this video
    start_times: tuple[float, ...] = ()  # Ref2VA reference video trims (one for all, or one per video reference)
    lora: AdapterChoice | None = None  # the request's LoRA adapter (h3serve.adapters), applied unmerged
    pinned_positions: tuple[float, ...] | None = None  # sigma positions before the shift (len steps + 1); None: uniform
    sample_solver: SampleSolver = DEFAULT_SAMPLE_SOLVER  # each modality's sampler (h3serve.model.scheduler)
    num_outputs: int = 1  # outputs of the prompt: output i is this plan at seed + i with one output (`output`)
    control: ControlRequest | None = None  # checked: its type, media and scale (1 when not given)
    force_refresh: ForceRefresh | None = None  # when the request's DiT cache starts afresh (rules.cache_refresh)
    preencode_batch_frames: int = 1  # the MP4 encoder takes the decoded frames in batches of at least this many
    video_preset: str | None = None  # the request's x264 preset (video_codec_options); None: the server's
    video_crf: int | None = None  # the request's CRF; None: the server's
    guides: tuple[PlacedGuide, ...] = ()  # timeline guides placed on the output's frames, in manifest order

    @property
    def continuation(self) -> bool:
        return self.long_video_mode == "continuation"

    @property
    def forwards(self) -> int:
        """Denoiser forwards the request runs, which its progress counts: `steps` per generated window (an
        extension's window 0 is its source video, not generated)."""
        if not self.continuation:
            return self.steps
        return self.steps * (len(self.windows) - (self.extend_video is not None))

    @property
    def progress_forwards(self) -> int:
        """Denoiser forwards of every output together: what a job's progress counts."""
        return self.forwards * self.num_outputs

    def output(self, index: int) -> GenerationPlan:
        """Output `index` of the plan as a plan of its own: the same request at seed + index, one output."""
        if not 0 <= index < self.num_outputs:
            raise IndexError(f"output {index} of a plan with {self.num_outputs}")
        return dataclasses.replace(self, seed=self.seed + index, num_outputs=1)

    @property
    def edit(self) -> bool:
        """Latent-mask editing (an all-1 mask is dropped, so a plan with none is plain generation)."""
        return self.video_mask is not None or self.audio_mask is not None

    @property
    def keyframes(self) -> tuple[MediaRef, ...]:
        """FL2VA keyframes in packed order (first, then last)."""
        return tuple(k for k in (self.image, self.last_image) if k is not None)

    @property
    def anchors(self) -> tuple[str, ...]:
        return tuple(a for a, k in (("first", self.image), ("last", self.last_image)) if k is not None)

    @property
    def duration_s(self) -> float:
        return self.num_frames / limits.FPS

    @property
    def latent_frames(self) -> int:
        return geometry.latent_frames(self.num_frames)

    @property
    def latent_height(self) -> int:
        return geometry.latent_edge(self.height)

    @property
    def latent_width(self) -> int:
        return geometry.latent_edge(self.width)

    @property
    def audio_latents(self) -> int:
        return geometry.audio_latents(self.num_frames)
