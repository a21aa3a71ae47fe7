"""The one request type every entry point (CLI, HTTP, web page) builds and the engine consumes."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from h3serve.rules.adapter_choice import AdapterChoice
from h3serve.rules.names import TASKS

MediaKind = Literal["image", "video", "audio"]
DIT_TASKS = {"transformer": ("t2va", "fl2va"), "transformer_ref": ("ref2va",)}  # checkpoint DiT -> what it serves


def tasks_served(dits: Iterable[str]) -> tuple[str, ...]:
    """The tasks a set of loaded DiT components serves, in TASKS order."""
    served = {task for dit in dits for task in DIT_TASKS[dit]}
    return tuple(task for task in TASKS if task in served)


@dataclass(frozen=True)
class MediaRef:
    """One input media file. Uploads and URL downloads are stored as local files before a request is built.

    `kind` is what the client declared (or None); the media intake decides from the bytes, never the name.
    """

    path: Path
    name: str  # how the client knows it (upload filename, URL, CLI path): used in error messages
    kind: MediaKind | None = None


@dataclass(frozen=True)
class ControlRequest:
    """A control video for the Fun ControlNet Union branch (one type per request): the control video (canny edges,
    depth, ...), and for inpainting a mask (white = regenerate) and the source it keeps elsewhere."""

    type: str  # names.CONTROL_TYPES
    control: MediaRef | None = None
    source: MediaRef | None = None
    mask: MediaRef | None = None
    scale: float | None = None  # control_context_scale: finite, >= 0; None: 1


@dataclass(frozen=True)
class TimelineGuide:
    """One timeline guide (h3serve/rules/guides.py): an image or a clip (`visual`, its `kind` "image" or "video"),
    a sound (`audio`), or a picture with a sound, placed at output frame `frame_index` (counted from the end when
    negative: -1 is the last frame). Its position in the request's tuple names it in errors (timeline_guides[i])."""

    frame_index: int
    visual: MediaRef | None = None
    audio: MediaRef | None = None


@dataclass(frozen=True)
class GenerationRequest:
    """What a user asked for, before validation. `None` means "use the model's default"."""

    prompt: str
    width: int | None = None
    height: int | None = None
    aspect_ratio: str | None = None  # "W:H", a number or auto/adaptive; beside width/height it must agree
    short_edge: int | None = None  # canvas mode 768 or 1440 (h3serve/rules/canvas.py)
    duration_s: float | None = None
    num_frames: int | None = None  # alternative to duration_s; snapped up to 17n + 5
    steps: int | None = None  # num_inference_steps: N denoiser forwards (N + 1 sigma points; diffusers' N + 1)
    sample_solver: str | None = None  # euler | res_multistep (any case, spaces ignored); None: euler
    seed: int | None = None
    num_outputs: int | None = None  # num_outputs_per_prompt: outputs of this prompt, output i at seed + i; None: 1
    flow_shift: float | None = None  # video sigma shift (checkpoint default 12)
    audio_flow_shift: float | None = None  # audio sigma shift (checkpoint default 3)
    task: str | None = None  # t2va | fl2va | ref2va; None: inferred from the inputs
    image: MediaRef | None = None  # FL2VA first keyframe
    last_image: MediaRef | None = None  # FL2VA last keyframe
    references: tuple[MediaRef, ...] = field(default_factory=tuple)  # Ref2VA images, videos, audio clips
    quality: str | None = None  # lossless (no DiT cache) | high (the built-in cache profile); None: the server's
    # Long video (h3serve/rules/long_video.py): long_video opts in; the mode is full (one pass, <= 30 s) or continuation
    # (windows, <= 300 s, the Ref2VA path). continuation_prompts: one per window (see validate for the main prompt).
    long_video: bool | None = None
    long_video_mode: str | None = None
    continuation_window_frames: int | None = None
    continuation_overlap_frames: int | None = None
    continuation_prompts: tuple[str, ...] | None = None
    # Latent-mask editing (h3serve/rules/edit_mask.py): sources, and masks as parsed JSON (a number or nested arrays);
    # audio_mode lock_source holds one driving audio (source_audio, or the one audio reference) as the soundtrack.
    source_video: MediaRef | None = None
    source_audio: MediaRef | None = None
    video_noise_mask: object = None
    audio_noise_mask: object = None
    audio_mode: str | None = None  # native | lock_source
    # OpenAI extensions: continue this video (its last overlap frames are the first window's latent guide; the
    # output is the video followed by the new part, duration_s long). remixed_from_video_id: provenance of a remix.
    # Ref2VA reference videos trimmed before this time: one value for all, or one per video reference, in order.
    start_time_seconds: float | tuple[float, ...] | None = None
    extend_video: MediaRef | None = None
    remixed_from_video_id: str | None = None
    # A per-request LoRA adapter, resolved by the entry point against the server's catalog (h3serve.adapters).
    lora: AdapterChoice | None = None
    control: ControlRequest | None = None  # a ControlNet control video (served with --controlnet-model-path)
    # vLLM-Omni's forced DiT-cache refresh (h3serve.rules.cache_refresh), extra_params only
    force_refresh_step_hint: int | None = None
    force_refresh_step_policy: str | None = None
    # vLLM-Omni's pre-encode fields (extra_params): the MP4 encoded while the VAE decodes (what a streamed decode
    # always does here, so preencode_mp4 is accepted either way), handed to the encoder in batches of at least
    # preencode_batch_frames frames (whole VAE clips; with preencode_mp4 only, as vLLM-Omni reads it), and the
    # request's H.264 settings (extra_params.video_codec_options: preset, crf).
    preencode_mp4: bool | None = None
    preencode_batch_frames: int | None = None
    video_preset: str | None = None
    video_crf: int | None = None
    guides: tuple[TimelineGuide, ...] = ()  # timeline guides, in manifest order (h3serve/rules/guides.py)
