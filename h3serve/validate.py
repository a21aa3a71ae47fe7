"""Request rules shared by every entry point: one `GenerationRequest` in, one `GenerationPlan` out.

A violation raises `RequestError` naming the field and the limit, so the CLI prints one line and the
server answers HTTP 400 with the same text.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from h3serve import geometry, limits
from h3serve.canvas import CanvasError, resolve_canvas
from h3serve.edit_mask import LatentMask, MaskError, audio_mask, video_mask
from h3serve.errors import RequestError
from h3serve.long_video import MODES, Window, max_duration_s, on_frame_grid, plan_windows, window_fits
from h3serve.names import AUDIO_MODES, QUALITIES, TASKS
from h3serve.request import GenerationRequest, MediaRef
from h3serve.schedule import PinnedSchedule, resolve_pinned_shift, resolve_steps

if TYPE_CHECKING:
    from h3serve.adapters.catalog import AdapterChoice


@dataclass(frozen=True)
class ModelDefaults:
    """Per-checkpoint defaults (read from the checkpoint, never hard-coded by callers)."""

    canvas_short_edge: int = 768
    canvas_max_pixels: int = 1_032_192
    reference_image_short_edge: int = 2048
    flow_shift: float = 12.0
    audio_flow_shift: float = 3.0
    max_edge: int = limits.MAX_EDGE
    pinned_schedule: PinnedSchedule | None = None  # a checkpoint's or adapter's own schedule (h3serve/schedule.py)
    fused_adapter: str | None = None  # the FastH3 adapter fused into the T2VA DiT (h3serve.adapters.fasth3)


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


def validate(
    request: GenerationRequest,
    defaults: ModelDefaults = ModelDefaults(),
    keyframe_size: tuple[int, int] | None = None,
    extend_frames: int | None = None,
) -> GenerationPlan:
    """Check every rule and resolve every default. Raises `RequestError` on the first violation.

    `keyframe_size` is the (width, height) of the first present FL2VA keyframe: its aspect sets the canvas
    unless the request gives a size or an aspect ratio. `extend_frames`: the 24 fps frame count of an
    extension's source video (measured by the caller).
    """
    request = driving_audio_split(request)
    task = resolve_task(request)
    defaults = _adapter_pin(request, task, defaults)
    mode = resolve_long_video_mode(request, task)
    height, width = _resolve_size(request, defaults, task, keyframe_size)
    num_frames = _resolve_frames(request, mode)
    quality = _check_quality(request.quality)
    source_frames = _resolve_extension(request, mode, extend_frames)
    if source_frames:  # the output is the source followed by the new part (a whole number of 17-frame chunks)
        num_frames = source_frames + num_frames - limits.VAE_LATENTS_PER_CHUNK
        if num_frames / limits.FPS > limits.MAX_CONTINUATION_DURATION_S:
            raise RequestError(
                "duration", f"the source ({source_frames / limits.FPS:.2f} s) and the extension together must be at "
                f"most {limits.MAX_CONTINUATION_DURATION_S:g} s, got {num_frames / limits.FPS:.2f} s"
            )
    windows, prompts = _resolve_continuation(request, mode, num_frames, quality, source_frames)
    masks = _resolve_edit(request, mode, num_frames, height, width)
    pin = defaults.pinned_schedule
    steps, flow_shift, audio_flow_shift = _resolve_schedule(request, defaults)
    return GenerationPlan(
        task=task,
        image=request.image,
        last_image=request.last_image,
        references=tuple(request.references),
        prompt=_check_prompt(request.prompt),
        width=width,
        height=height,
        num_frames=num_frames,
        steps=steps,
        seed=_check_int("seed", request.seed, limits.SEED_MIN, limits.SEED_MAX, limits.DEFAULT_SEED),
        flow_shift=flow_shift,
        audio_flow_shift=audio_flow_shift,
        quality=quality,
        long_video_mode=mode,
        windows=windows,
        window_prompts=prompts,
        source_video=request.source_video,
        source_audio=request.source_audio,
        video_mask=masks[0],
        audio_mask=masks[1],
        audio_mode=request.audio_mode or "native",
        extend_video=request.extend_video,
        start_times=resolve_start_times(request, task),
        lora=request.lora,
        pinned_positions=None if pin is None else pin.positions,
    )


def _adapter_pin(request: GenerationRequest, task: str, defaults: ModelDefaults) -> ModelDefaults:
    """The defaults under the request's adapter: a Turbo LoRA pins its forward count and shifts (its file name's
    contract); a server with a fused FastH3 adapter already pins its schedule and serves T2VA without `lora`."""
    if defaults.fused_adapter is not None:
        from h3serve.adapters.fasth3 import TASKS

        if task not in TASKS:
            raise RequestError("task", f"this server fuses the FastH3 adapter {defaults.fused_adapter}, which serves "
                                       f"{', '.join(TASKS)} only, not {task}")
        if request.lora is not None:
            raise RequestError("lora", f"this server fuses the FastH3 adapter {defaults.fused_adapter}; a per-request "
                                       "LoRA cannot run on top of it")
    if request.lora is None or request.lora.turbo is None:
        return defaults
    from h3serve.adapters.turbo import turbo_pin

    return dataclasses.replace(defaults, pinned_schedule=turbo_pin(request.lora.turbo, request.lora.name, task))


def _resolve_schedule(request: GenerationRequest, defaults: ModelDefaults) -> tuple[int, float, float]:
    """(steps, flow_shift, audio_flow_shift): the forward count and both shifts, under any pinned schedule."""
    pin = defaults.pinned_schedule
    steps = resolve_steps(request.steps, pin)
    pinned = [resolve_pinned_shift(name, getattr(request, name), pin) for name in ("flow_shift", "audio_flow_shift")]
    flow_shift = pinned[0] if pinned[0] is not None else _check_shift("flow_shift", request.flow_shift,
                                                                         defaults.flow_shift)
    audio = pinned[1] if pinned[1] is not None else _check_shift("audio_flow_shift", request.audio_flow_shift,
                                                                    defaults.audio_flow_shift)
    return steps, flow_shift, audio


def resolve_start_times(request: GenerationRequest, task: str) -> tuple[float, ...]:
    """`start_time_seconds` as a tuple of finite seconds >= 0; only for Ref2VA (it trims reference videos, not
    an edit's source_video). Whether the count matches the video references is the media intake's check."""
    value = request.start_time_seconds
    if value is None:
        return ()
    if task != "ref2va":
        raise RequestError("start_time_seconds", f"trims Ref2VA reference videos; this request is {task}")
    values = value if isinstance(value, tuple | list) else (value,)
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v < 0:
            raise RequestError("start_time_seconds", f"must be seconds >= 0 (one, or one per video), got {v!r}")
    if not values:
        raise RequestError("start_time_seconds", "must not be an empty list")
    return tuple(float(v) for v in values)


def _resolve_extension(request: GenerationRequest, mode: str | None, extend_frames: int | None) -> int:
    """An extension's source length in frames, snapped down to 17n + 5 (0 without an extension)."""
    if request.extend_video is None:
        return 0
    if mode != "continuation":
        raise RequestError("extend_video", "an extension is a continuation (long_video_mode=continuation)")
    if extend_frames is None:
        raise RequestError("extend_video", "the source video's length was not measured")
    block, rest = limits.VAE_FRAMES_PER_CHUNK, limits.VAE_LATENTS_PER_CHUNK
    overlap = request.continuation_overlap_frames or limits.DEFAULT_OVERLAP_FRAMES
    frames = (extend_frames - rest) // block * block + rest if extend_frames >= rest else 0
    if frames <= overlap:
        raise RequestError(
            "extend_video", f"is {extend_frames} frames at {limits.FPS} fps; an extension needs more than the "
            f"overlap ({overlap} frames)"
        )
    return frames




def driving_audio_split(request: GenerationRequest) -> GenerationRequest:
    """audio_mode=lock_source: the one driving audio as `source_audio` (an audio reference is taken out of the
    references, so it does not make the request Ref2VA). Other requests are returned as they are."""
    if request.audio_mode not in (None, *AUDIO_MODES):
        raise RequestError("audio_mode", f"must be native or lock_source, got {request.audio_mode!r}")
    if request.audio_mode != "lock_source":
        return request
    audio_refs = [r for r in request.references if r.kind == "audio"]
    if len(audio_refs) + (request.source_audio is not None) != 1:
        raise RequestError(
            "audio_mode", "lock_source requires exactly one driving audio (source_audio, or one audio reference)"
        )
    if request.source_audio is not None:
        return request
    rest = tuple(r for r in request.references if r.kind != "audio")
    return dataclasses.replace(request, references=rest, source_audio=audio_refs[0])


def _resolve_edit(
    request: GenerationRequest, mode: str | None, num_frames: int, height: int, width: int
) -> tuple[LatentMask | None, LatentMask | None]:
    """The canonical (video, audio) masks; the rules between sources, masks, continuation and lock_source."""
    lock = request.audio_mode == "lock_source"
    has_video_mask, has_audio_mask = request.video_noise_mask is not None, request.audio_noise_mask is not None
    if not (has_video_mask or has_audio_mask):
        if request.source_video is not None:
            raise RequestError("source_video", "edit sources require video_noise_mask or audio_noise_mask")
        if request.source_audio is not None and not lock:
            raise RequestError("source_audio", "requires an audio_noise_mask (or audio_mode=lock_source)")
    if request.extend_video is not None and (has_video_mask or has_audio_mask):
        field = "video_noise_mask" if has_video_mask else "audio_noise_mask"
        raise RequestError(field, "an extension cannot be combined with latent-mask editing")
    if has_video_mask and request.source_video is None:
        raise RequestError("video_noise_mask", "requires source_video")
    if has_audio_mask and request.source_video is None and request.source_audio is None:
        raise RequestError("audio_noise_mask", "requires source_audio or source_video")
    if has_audio_mask and lock:
        raise RequestError(
            "audio_noise_mask", "audio_mode=lock_source cannot be combined with audio latent-mask editing"
        )
    lt = geometry.latent_frames(num_frames)
    lh, lw = geometry.latent_edge(height), geometry.latent_edge(width)
    at = geometry.audio_latents(num_frames)
    try:
        field = "video_noise_mask"
        video = video_mask(request.video_noise_mask, lt, lh, lw) if has_video_mask else None
        field = "audio_noise_mask"
        audio = audio_mask(request.audio_noise_mask, at) if has_audio_mask else None
    except MaskError as e:
        raise RequestError(field, str(e)) from None
    if lock:  # the driving audio is kept whole: an all-0 audio mask over its soundtrack
        audio = audio_mask(0.0, at)
    return video, audio


def _check_quality(quality: str | None) -> str | None:
    if quality not in (None, *QUALITIES):
        raise RequestError("quality", f"must be one of {', '.join(QUALITIES)}, got {quality!r}")
    return quality


def resolve_task(request: GenerationRequest) -> str:
    """references -> ref2va, keyframes -> fl2va, else t2va; an explicit task must agree with the inputs."""
    has_keyframes = request.image is not None or request.last_image is not None
    continuation = request.long_video is True and request.long_video_mode == "continuation"
    if continuation and request.task is None and not has_keyframes:
        return "ref2va"  # continuation runs on the Ref2VA path; its windows' latent guides are its references
    if has_keyframes and request.references:
        raise RequestError("references", "keyframes (image / last_image) and references cannot be combined")
    inferred = "ref2va" if request.references else "fl2va" if has_keyframes else "t2va"
    task = request.task
    if task is None:
        return inferred
    if task not in TASKS:
        raise RequestError("task", f"must be one of {', '.join(TASKS)}, got {task!r}")
    if task != inferred and inferred != "t2va":
        what = "references" if request.references else "keyframes"
        raise RequestError("task", f"{task} does not take {what}; this request is {inferred}")
    if task == "ref2va" and not request.references and not continuation:
        raise RequestError("task", "ref2va needs at least one reference (image, video or audio)")
    if task == "fl2va" and not has_keyframes:
        raise RequestError("task", "fl2va needs a first and/or last keyframe image")
    return task


def _check_prompt(prompt: object) -> str:
    if not isinstance(prompt, str):
        raise RequestError("prompt", "must be a string")
    if not prompt.strip():
        raise RequestError("prompt", "must not be empty")
    if len(prompt) > limits.MAX_PROMPT_CHARS:
        raise RequestError(
            "prompt", f"is {len(prompt)} characters long; the limit is {limits.MAX_PROMPT_CHARS}"
        )
    return prompt


def _check_int(field: str, value: object, lo: int, hi: int, default: int) -> int:
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(field, f"must be an integer, got {value!r}")
    if not lo <= value <= hi:
        raise RequestError(field, f"must be between {lo} and {hi}, got {value}")
    return value


def _check_shift(field: str, value: object, default: float) -> float:
    if value is None:
        return float(default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise RequestError(field, f"must be a finite number, got {value!r}")
    if not 0 < value <= limits.MAX_FLOW_SHIFT:
        raise RequestError(field, f"must be greater than 0 and at most {limits.MAX_FLOW_SHIFT:g}, got {value:g}")
    return float(value)


_CONTINUATION_FIELDS = ("continuation_window_frames", "continuation_overlap_frames", "continuation_prompts")


def resolve_long_video_mode(request: GenerationRequest, task: str) -> str | None:
    """None without `long_video`; else the mode (default: continuation for ref2va, full otherwise)."""
    long_video, mode = request.long_video, request.long_video_mode
    if long_video is not None and not isinstance(long_video, bool):
        raise RequestError("long_video", f"must be a boolean, got {long_video!r}")
    if mode is not None and mode not in MODES:
        raise RequestError("long_video_mode", f"must be full or continuation, got {mode!r}")
    if not long_video:
        if mode is not None:
            raise RequestError("long_video_mode", "needs long_video=true")
        mode = None
    elif mode is None:
        mode = "continuation" if task == "ref2va" else "full"
    if mode == "continuation" and task != "ref2va":
        raise RequestError(
            "long_video_mode", f"continuation requires Ref2VA request execution (task ref2va); this request is {task}"
        )
    if mode != "continuation":
        for name in _CONTINUATION_FIELDS:
            if getattr(request, name) is not None:
                raise RequestError(name, "only with long_video=true and long_video_mode=continuation")
    return mode


def _duration_hint(mode: str | None) -> str:
    if mode is None:
        return (
            f" (long_video=true allows up to {limits.MAX_FULL_DURATION_S:g} s in one pass, "
            f"{limits.MAX_CONTINUATION_DURATION_S:g} s by continuation)"
        )
    return f" (long_video_mode={mode})"


def _resolve_continuation(
    request: GenerationRequest, mode: str | None, num_frames: int, quality: str | None, source_frames: int = 0
) -> tuple[tuple[Window, ...], tuple[str, ...]]:
    """The windows and each window's prompt. The main prompt describes the whole video and is kept in every
    window; `continuation_prompts[i]` (if given) is appended to it, after a space, for window i. An extension's
    window 0 is its source: the prompts are then for the generated windows only."""
    if mode != "continuation":
        return (), ()
    if quality == "high":
        raise RequestError("quality", "continuation requires uncached denoising; set quality=lossless")
    sizes = {}
    for name, default in (
        ("continuation_window_frames", limits.DEFAULT_WINDOW_FRAMES),
        ("continuation_overlap_frames", limits.DEFAULT_OVERLAP_FRAMES),
    ):
        value = getattr(request, name)
        value = default if value is None else value
        if not on_frame_grid(value):
            what = name.split("_")[1]
            raise RequestError(
                name, f"the continuation {what} must be an integer on the 17n+5 frame grid, got {value!r}"
            )
        sizes[name] = value
    window, overlap = sizes["continuation_window_frames"], sizes["continuation_overlap_frames"]
    if not window_fits(window, overlap):
        only_overlap_given = request.continuation_window_frames is None
        field = "continuation_overlap_frames" if only_overlap_given else "continuation_window_frames"
        raise RequestError(
            field,
            f"the continuation window must be {limits.MIN_WINDOW_FRAMES}..{limits.MAX_WINDOW_FRAMES} frames and "
            f"exceed its overlap, got window {window} and overlap {overlap}",
        )
    windows = plan_windows(num_frames, window, overlap, source_frames or None)
    generated = len(windows) - (1 if source_frames else 0)
    prompts = request.continuation_prompts
    if prompts is None:
        return windows, (request.prompt,) * len(windows)
    if (
        not isinstance(prompts, tuple | list)
        or len(prompts) != generated
        or not all(isinstance(p, str) and p.strip() for p in prompts)
    ):
        count = len(prompts) if isinstance(prompts, tuple | list) else prompts
        raise RequestError(
            "continuation_prompts",
            f"must contain exactly {generated} non-empty strings (one per generated window of {num_frames} "
            f"frames), got {count!r}",
        )
    combined = tuple(f"{request.prompt} {p}" for p in prompts)
    for i, text in enumerate(combined):
        if len(text) > limits.MAX_PROMPT_CHARS:
            raise RequestError(
                f"continuation_prompts[{i}]",
                f"with the main prompt is {len(text)} characters long; the limit is {limits.MAX_PROMPT_CHARS}",
            )
    return windows, (request.prompt,) * (len(windows) - generated) + combined


def _resolve_frames(request: GenerationRequest, mode: str | None = None) -> int:
    lo, hi = limits.MIN_DURATION_S, max_duration_s(mode)
    frames_from_duration = None
    if request.duration_s is not None:
        d = request.duration_s
        if isinstance(d, bool) or not isinstance(d, int | float) or not math.isfinite(d):
            raise RequestError("duration", f"must be a number of seconds, got {d!r}")
        if not lo <= d <= hi:
            raise RequestError(
                "duration", f"must be between {lo:g} and {hi:g} seconds{_duration_hint(mode)}, got {d:g}"
            )
        frames_from_duration = geometry.frames_for_duration(d)
    if request.num_frames is None:
        return frames_from_duration or geometry.frames_for_duration(limits.DEFAULT_DURATION_S)

    n = request.num_frames
    lo_frames, hi_frames = int(lo * limits.FPS), int(hi * limits.FPS)
    if isinstance(n, bool) or not isinstance(n, int):
        raise RequestError("num_frames", f"must be an integer, got {n!r}")
    if not lo_frames <= n <= hi_frames:
        raise RequestError(
            "num_frames",
            f"must be between {lo_frames} and {hi_frames} ({lo:g}-{hi:g} s at {limits.FPS} fps)"
            f"{_duration_hint(mode)}, got {n}",
        )
    snapped = geometry.snap_frames_up(n)
    if frames_from_duration is not None and frames_from_duration != snapped:
        raise RequestError(
            "num_frames",
            f"{n} frames ({snapped} after snapping) contradicts duration {request.duration_s:g} s "
            f"({frames_from_duration} frames); give one of them",
        )
    return snapped


def _resolve_size(
    request: GenerationRequest, defaults: ModelDefaults, task: str, keyframe_size: tuple[int, int] | None
) -> tuple[int, int]:
    """(height, width) by the canvas rule (h3serve/canvas.py)."""
    try:
        return resolve_canvas(defaults, task, request.width, request.height, request.aspect_ratio,
                              request.short_edge, keyframe_size)
    except CanvasError as e:
        raise RequestError(e.field, e.message) from None
