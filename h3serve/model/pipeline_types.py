"""The pipeline's data types: its components, conditioning, targets, results, and the stage clock and hooks.

Shared by `h3serve.model.pipeline` (T2VA / FL2VA / Ref2VA) and `h3serve.model.continuation` (long video windows).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch
from PIL import Image
from torch import nn

from h3serve.model.conditioning import GuideMedia, Reference
from h3serve.model.controlnet import ControlInput
from h3serve.model.layout import Layout, ReferenceBlock
from h3serve.model.text_encoder import TextConditioner
from h3serve.model.transformer import H3Transformer
from h3serve.model.vision_inputs import VisionProcessorConfig
from h3serve.rules.cache_refresh import ForceRefresh
from h3serve.rules.request import tasks_served
from h3serve.rules.validate import GenerationPlan

StepCallback = Callable[[int, int], None]  # (steps done, total); may raise to abort the request


@dataclass
class H3Components:
    """Everything one pipeline needs, already on its device."""

    transformer: H3Transformer | None  # T2VA / FL2VA DiT
    transformer_ref: H3Transformer | None  # Ref2VA DiT
    vae: nn.Module  # AutoencoderKLMiniMaxH3
    audio_vae: nn.Module  # AutoencoderKLMiniMaxH3Audio
    text: TextConditioner
    vision_config: VisionProcessorConfig  # Qwen3-VL image/video preprocessing

    @property
    def tasks(self) -> tuple[str, ...]:
        """Tasks the loaded DiTs can serve."""
        loaded = {"transformer": self.transformer, "transformer_ref": self.transformer_ref}
        return tasks_served(name for name, dit in loaded.items() if dit is not None)


class FrameWriter(Protocol):
    """Takes a streamed decode's frames in order: uint8 [t, H, W, 3] RGB, host arrays, or with `on_device` the
    decoder's own device tensors (an encoder that reads device memory, h3serve.media.nvenc)."""

    on_device: bool

    def write(self, frames: np.ndarray | torch.Tensor) -> None: ...

    @property
    def span(self) -> tuple[float, float] | None:
        """After the writer closed: (start, end) of its encoding on the `time.monotonic` clock, None if it
        encoded nothing (a rank that receives no frames)."""
        ...


class FrameSink(Protocol):
    """Where a streamed decode goes (`--decode-mode stream`): opened once the soundtrack is decoded, then fed
    the video's uint8 frames chunk by chunk (h3serve.media.sink writes them into an MP4)."""

    def open(self, num_frames: int, height: int, width: int, audio: np.ndarray) -> AbstractContextManager[FrameWriter]:
        ...

    def for_output(self, index: int) -> FrameSink: ...  # where output `index` (>= 1) of several goes


@dataclass
class CacheStats:
    """One request's cache outcome: DiT block evaluations that ran (counted by hooks) and that were skipped."""

    evaluated: int = 0
    skipped: int = 0
    cached_steps: int = 0


class BlockCache(Protocol):
    """The DiT block cache the rank side injects (h3serve.accel.cache: cache-dit's DBCache or TeaCache): for one
    request, a context around its denoise loop that yields the cache's stats, or None when the request runs the
    plain loop (its `quality`, the server's profile)."""

    def active(self, quality: str | None) -> bool: ...  # whether a request of this `quality` runs cached

    def for_request(
        self, dit: H3Transformer, quality: str | None, forwards: int, refresh: ForceRefresh | None = None
    ) -> AbstractContextManager[CacheStats | None]: ...


@dataclass
class GenerationResult:
    video: torch.Tensor | None  # [T, H, W, 3] float32 in [0, 1]; None when streamed into a FrameSink
    audio: torch.Tensor  # [2, N] float32 in [-1, 1] at 32 kHz
    video_latents: torch.Tensor  # [1, 24, F, lh, lw] normalised latents, fp32
    audio_latents: torch.Tensor  # [2, 32, A] normalised latents, fp32
    stage_durations: dict[str, float] = field(default_factory=dict)
    block_cache: CacheStats | None = None  # with a DiT block cache: evaluations run and skipped, cached steps
    num_frames: int = 0  # frames decoded (streamed or not)
    others: list[GenerationResult] = field(default_factory=list)  # several outputs: outputs 1..N-1, in order
    stage_timeline: list[StageSpan] = field(default_factory=list)  # every stage's start and end, in start order

    @classmethod
    def decoded(
        cls,
        video: torch.Tensor | None,
        audio: torch.Tensor,
        latents: tuple[torch.Tensor, torch.Tensor],
        clock: StageClock,
        cache: CacheStats | None,
        num_frames: int,
    ) -> GenerationResult:
        """A finished request's result, full or streamed decode; the latents leave the device with it. Its stage
        figures are the clock's own (several outputs of one run share them)."""
        video_latents, audio_latents = latents
        return cls(video, audio, video_latents.cpu(), audio_latents.cpu(), clock.durations, cache, num_frames,
                   stage_timeline=clock.timeline)


class StageHooks(Protocol):
    """Told where a request is, so that weights can be placed for each stage (h3serve.offload carries it out)."""

    def request(self, task: str) -> AbstractContextManager[None]: ...

    def stage(self, name: str) -> AbstractContextManager[None]: ...

    def weights(self, module: nn.Module) -> AbstractContextManager[None]:
        """`module`'s weights on the device for the duration (AdaLN projections kept in host memory)."""
        ...


class NoHooks:
    def request(self, task: str) -> AbstractContextManager[None]:
        return nullcontext()

    def stage(self, name: str) -> AbstractContextManager[None]:
        return nullcontext()

    def weights(self, module: nn.Module) -> AbstractContextManager[None]:
        return nullcontext()


StageSpan = tuple[str, float, float]  # (stage, start, end) on the `time.monotonic` clock


class StageClock:
    """Accumulates wall time per named stage (synchronising the GPU so the figures are real); each stage runs
    inside the placement hooks' `stage(name)`, so its time includes moving its weights in.

    Every run of a stage is also kept as a span on the `time.monotonic` clock (`timeline`): one clock for every
    process of a host (Linux CLOCK_MONOTONIC), so the parent can place a rank's spans beside its own, and a stage
    that runs beside another (the MP4 encode on its own thread, `span`) shows its overlap."""

    def __init__(self, device: torch.device, hooks: StageHooks | None = None):
        self.device = device
        self.hooks = hooks or NoHooks()
        self.durations: dict[str, float] = {}
        self.timeline: list[StageSpan] = []
        self.steps = 0  # denoise steps run (a continuation runs several windows)
        self._lock = threading.Lock()  # `span` may be called from an encoder's thread

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        start = time.monotonic()
        with self.hooks.stage(name):
            yield
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.span(name, start, time.monotonic())

    def span(self, name: str, start: float, end: float) -> None:
        """Record a run of `name` from `start` to `end` (`time.monotonic`), measured by its caller."""
        with self._lock:
            self.durations[name] = self.durations.get(name, 0.0) + end - start
            self.timeline.append((name, start, end))

    def record_denoise_per_step(self) -> None:
        """The denoise stage's mean time per step (over every window of a continuation), once denoising is done."""
        self.durations["denoise_per_step"] = self.durations["denoise"] / max(1, self.steps)


@dataclass
class Conditioning:
    """Decoded, normalised conditioning for one request (empty for T2VA)."""

    keyframes: list[Image.Image] = field(default_factory=list)  # FL2VA, on the canvas, in packed order
    anchors: tuple[str, ...] = ()  # "first" / "last", one per keyframe
    references: list[Reference] = field(default_factory=list)  # Ref2VA, normalised, in request order
    edit_video: np.ndarray | None = None  # latent-mask editing: source frames (T, H, W, 3) uint8 on the canvas
    edit_audio: torch.Tensor | None = None  # source (or lock_source driving) audio (2, N) at 32 kHz
    extend_video: np.ndarray | None = None  # an extension's source frames (T, H, W, 3) uint8: window 0
    extend_audio: torch.Tensor | None = None  # ... and its soundtrack (2, N) at 32 kHz, if it has one
    control: ControlPixels | None = None  # a ControlNet request's media on the canvas
    guides: list[GuideMedia] = field(default_factory=list)  # timeline guides, decoded, in the request's order


@dataclass
class ControlPixels:
    """A ControlNet request's media at the canvas and the output's frame count, fp32: the control video
    [1, 3, T, H, W] in [0, 1], the inpainting source likewise, and the mask [1, 1, T, H, W] in {0, 1}
    (1 = regenerate); absent parts None."""

    scale: float
    control: torch.Tensor | None = None
    source: torch.Tensor | None = None
    mask: torch.Tensor | None = None


@dataclass(frozen=True)
class LatentTarget:
    """The generated latents' shape: video latent frames and canvas, audio latents per channel."""

    latent_frames: int
    latent_height: int
    latent_width: int
    audio_latents: int

    @classmethod
    def of(cls, plan: GenerationPlan) -> LatentTarget:
        """The whole request's target (a continuation window has its own frames and audio latents)."""
        return cls(plan.latent_frames, plan.latent_height, plan.latent_width, plan.audio_latents)


@dataclass
class ReferenceMedia:
    """Ref2VA references encoded once per request (a continuation reuses them in every window)."""

    ids: list[int]  # the presentation's reference part (labels and vision blocks), before the prompt
    tags: list[int]
    vision: dict[str, torch.Tensor]
    visual: list[torch.Tensor]  # normalised condition latents [1, 24, F, h, w], packed order
    audio_rows: list[torch.Tensor]  # clean reference audio rows [2·La, 32], packed order
    blocks: list[ReferenceBlock]


@dataclass
class LatentGuide:
    """A continuation window's carry-over: the previous window's last overlap latents, clean and normalised."""

    video: torch.Tensor  # [1, 24, F, lh, lw]
    audio: torch.Tensor  # [2, 32, A]

    def audio_rows(self) -> torch.Tensor:
        """Channel-major rows [2·A, 32], the packing of every audio block."""
        return self.audio.permute(0, 2, 1).reshape(-1, self.audio.shape[1])


@dataclass
class Encoded:
    """Everything the loop needs from the conditioning stage."""

    token_ids: list[int]  # the presentation the text encoder read
    text_states: torch.Tensor  # [1, L, text_dim]
    layout: Layout
    visual: list[torch.Tensor]  # normalised condition latents [1, 24, F, h, w], packed order
    audio_rows: list[torch.Tensor]  # clean reference audio rows [2·La, 32], packed order
    control: ControlInput | None = None  # a control video's rows for the ControlNet branch
    # Leading entries of `visual` that are timeline guides: their condition noise comes from a CPU generator of
    # their own, seeded with the request's seed (vLLM-Omni's guided mode), so a guide leaves the targets' noise as is.
    guide_visuals: int = 0
