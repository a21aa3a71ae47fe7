"""`validate`: one `GenerationRequest` in, one `GenerationPlan` out, every default resolved; with the rules of
the canvas, the schedule (steps, shifts and solver, under an adapter's pinned schedule), the seed, prompt and
quality."""

from __future__ import annotations

import dataclasses
import math
from typing import cast

from h3serve.errors import RequestError
from h3serve.rules import limits
from h3serve.rules.adapter_choice import FASTH3_TASKS, flashgen_pin, merged_choice, pdd_pin, turbo_pin
from h3serve.rules.cache_refresh import resolve_force_refresh
from h3serve.rules.canvas import CanvasError, resolve_canvas
from h3serve.rules.defaults import ModelDefaults
from h3serve.rules.edit_mask import LatentMask
from h3serve.rules.guides import GuideContext, GuideProbe, PlacedGuide, place_guides
from h3serve.rules.names import (
    CONTROL_TYPES,
    DEFAULT_CRF,
    DEFAULT_SAMPLE_SOLVER,
    QUALITIES,
    SAMPLE_SOLVERS,
    X264_PRESETS,
    SampleSolver,
)
from h3serve.rules.request import ControlRequest, GenerationRequest
from h3serve.rules.schedule import PinnedSchedule, resolve_pinned_shift, resolve_steps
from h3serve.rules.shown import shown
from h3serve.rules.validate.generation_plan import GenerationPlan
from h3serve.rules.validate.inputs import (
    driving_audio_split,
    resolve_edit,
    resolve_extension,
    resolve_start_times,
    resolve_task,
)
from h3serve.rules.validate.length import resolve_continuation, resolve_frames, resolve_long_video_mode


def validate(
    request: GenerationRequest,
    defaults: ModelDefaults = ModelDefaults(),  # noqa: B008 (frozen)
    keyframe_size: tuple[int, int] | None = None,
    extend_frames: int | None = None,
    guide_probes: tuple[GuideProbe, ...] = (),
) -> GenerationPlan:
    """Check every rule and resolve every default. Raises `RequestError` on the first violation.

    `keyframe_size` is the (width, height) of the first present FL2VA keyframe: its aspect sets the canvas
    unless the request gives a size or an aspect ratio. `extend_frames`: the 24 fps frame count of an
    extension's source video (measured by the caller). `guide_probes`: what the media intake measured of each
    timeline guide's files, in the request's order.
    """
    request = driving_audio_split(request)
    task = resolve_task(request)
    if defaults.merged_lora is not None:  # every request runs the adapter in the weights (--merge-lora)
        request = dataclasses.replace(request, lora=merged_choice(defaults.merged_lora, request.lora, task))
    defaults = _adapter_pin(request, task, defaults)
    mode = resolve_long_video_mode(request, task)
    height, width = _resolve_size(request, defaults, task, keyframe_size)
    num_frames = resolve_frames(request, mode)
    quality = _check_quality(request.quality)
    source_frames = resolve_extension(request, mode, extend_frames)
    if source_frames:  # the output is the source followed by the new part (a whole number of 17-frame chunks)
        num_frames = source_frames + num_frames - limits.VAE_LATENTS_PER_CHUNK
        if num_frames / limits.FPS > limits.MAX_CONTINUATION_DURATION_S:
            raise RequestError(
                "duration",
                f"the source ({source_frames / limits.FPS:.2f} s) and the extension together must be at "
                f"most {limits.MAX_CONTINUATION_DURATION_S:g} s, got {num_frames / limits.FPS:.2f} s",
            )
    windows, prompts = resolve_continuation(request, mode, num_frames, quality, source_frames)
    masks = resolve_edit(request, mode, num_frames, height, width)
    pin = defaults.pinned_schedule
    steps, flow_shift, audio_flow_shift = _resolve_schedule(request, defaults)
    sample_solver = resolve_sample_solver(request.sample_solver, pin)
    seed = check_int("seed", request.seed, limits.SEED_MIN, limits.SEED_MAX, limits.DEFAULT_SEED)
    num_outputs = resolve_num_outputs(request.num_outputs, seed)
    control = resolve_control(request, task, mode, masks, quality, defaults.controlnet)
    refresh = resolve_force_refresh(request.force_refresh_step_hint, request.force_refresh_step_policy, steps,
                                    request_cache(quality, defaults.server_cache, task, mode))
    batch_frames, preset, crf = resolve_output_encoding(request, num_frames)
    guides = resolve_guides(request, defaults, guide_probes, task, num_frames, height, width, quality, mode, masks)
    return GenerationPlan(
        task=task,
        image=request.image,
        last_image=request.last_image,
        references=tuple(request.references),
        prompt=check_prompt(request.prompt),
        width=width,
        height=height,
        num_frames=num_frames,
        steps=steps,
        seed=seed,
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
        sample_solver=sample_solver,
        num_outputs=num_outputs,
        control=control,
        force_refresh=refresh,
        preencode_batch_frames=batch_frames,
        video_preset=preset,
        video_crf=crf,
        guides=guides,
    )


def resolve_output_encoding(request: GenerationRequest, num_frames: int) -> tuple[int, str | None, int | None]:
    """vLLM-Omni's pre-encode fields: the encoder's batch (with preencode_mp4 only: 17 frames unless given, one
    VAE clip; else each clip as it comes), and video_codec_options' x264 preset and CRF (0 to 51)."""
    batch = 1
    if request.preencode_mp4:
        given = request.preencode_batch_frames
        if given is not None and (isinstance(given, bool) or not isinstance(given, int) or given < 1):
            raise RequestError("preencode_batch_frames", f"must be a positive integer of frames, got {given!r}")
        batch = min(given or limits.VAE_FRAMES_PER_CHUNK, num_frames)
    preset = request.video_preset
    if preset is not None and preset not in X264_PRESETS:
        raise RequestError("video_codec_options.preset", f"choose from: {', '.join(X264_PRESETS)}; got {preset!r}")
    crf = request.video_crf
    crf = None if crf is None else check_int("video_codec_options.crf", crf, 0, 51, DEFAULT_CRF)
    return batch, preset, crf


def resolve_guides(
    request: GenerationRequest,
    defaults: ModelDefaults,
    probes: tuple[GuideProbe, ...],
    task: str,
    num_frames: int,
    height: int,
    width: int,
    quality: str | None,
    mode: str | None,
    masks: tuple[LatentMask | None, LatentMask | None],
) -> tuple[PlacedGuide, ...]:
    """The request's timeline guides placed (h3serve/rules/guides.py), under the adapter's pinned schedule (after
    `_adapter_pin`) and the DiT cache the request would run under (`request_cache`); refused beside a continuation,
    an edit or a control video."""
    if not request.guides:
        return ()
    other = None
    if mode == "continuation":
        other = ("guides are placed on one pass's frames; a continuation's windows each denoise their own "
                 "(use long_video_mode=full, or no long video)")
    elif any(m is not None for m in masks):
        other = "a latent-mask edit already fixes the frames it keeps from its source; it takes no guides"
    elif request.control is not None:
        other = "a control video's rows line up with the generated rows only; it takes no guides"
    pin = defaults.pinned_schedule
    ctx = GuideContext(
        num_frames=num_frames,
        latent_h=height // limits.VAE_SPATIAL_COMPRESSION,
        latent_w=width // limits.VAE_SPATIAL_COMPRESSION,
        keyframes=sum(k is not None for k in (request.image, request.last_image)),
        quality=quality,
        cache=request_cache(quality, defaults.server_cache, task, mode),
        pinned_owner=None if pin is None else pin.owner,
        refusal=defaults.guide_refusal,
        other=other,
    )
    return place_guides(request.guides, probes, ctx, defaults.guide_limits)


TEA_CACHE_TASKS = ("t2va", "fl2va")  # TeaCache is calibrated for the FL2VA DiT (which serves both) only


def request_cache(quality: str | None, server: str | None, task: str, mode: str | None) -> str | None:
    """The DiT cache a request runs under: `cache_dit` for quality=high, the server's (--cache-backend) when
    quality is omitted, none for lossless; TeaCache only on the FL2VA DiT, and no cache in a continuation."""
    if mode == "continuation" or quality == "lossless":
        return None
    if quality == "high":
        return "cache_dit"
    if server == "tea_cache" and task not in TEA_CACHE_TASKS:
        return None
    return server


def resolve_control(
    request: GenerationRequest, task: str, mode: str | None, masks: tuple[LatentMask | None, LatentMask | None],
    quality: str | None, served: bool = True,
) -> ControlRequest | None:
    """A control request checked: on an engine with a ControlNet (`served`), one known type with its media
    (inpaint: a mask; the others: a control video; a source only beside a mask), a finite scale in
    [0, MAX_CONTROL_SCALE] (default 1), on a T2VA request without long video, edits or the DiT cache (the control
    rows cover the generated video's tokens only)."""
    control = request.control
    if control is None:
        return None
    field = f"extra_params.{control.type}"
    if control.type not in CONTROL_TYPES:
        raise RequestError("control",
                           f"the control type is one of {', '.join(CONTROL_TYPES)}, got {shown(control.type)}")
    if not served:
        raise RequestError(field, "this server serves no ControlNet (start it with --controlnet-model-path)")
    if control.type == "inpaint" and control.mask is None:
        raise RequestError(field, "inpaint control needs a mask (mask_path or mask_reference)")
    if control.type != "inpaint" and control.control is None:
        raise RequestError(field, f"{control.type} control needs a control video (control_path or control_reference)")
    if control.source is not None and control.mask is None:
        raise RequestError(field, "a source video needs a mask (mask_path or mask_reference)")
    scale = 1.0 if control.scale is None else control.scale
    if (isinstance(scale, bool) or not isinstance(scale, int | float) or not math.isfinite(scale)
            or not 0 <= scale <= limits.MAX_CONTROL_SCALE):
        raise RequestError(f"{field}.control_context_scale",
                           f"must be a finite number from 0 to {limits.MAX_CONTROL_SCALE:g}, got {shown(scale)}")
    if task != "t2va":
        raise RequestError(field, f"a control video steers T2VA requests only (its rows cover the generated video), "
                                  f"not {task}")
    if mode is not None or any(m is not None for m in masks):
        raise RequestError(field, "a control video cannot be combined with long video or a latent-mask edit")
    if quality == "high":
        raise RequestError(field, "a control video runs every DiT block: not with quality=high (the DiT cache)")
    return dataclasses.replace(control, scale=float(scale))


def resolve_num_outputs(value: object, seed: int) -> int:
    """How many outputs of the prompt (1 to MAX_OUTPUTS_PER_PROMPT, default 1); output i runs at seed + i, so the
    last seed must be a valid seed too."""
    count = check_int("num_outputs", value, 1, limits.MAX_OUTPUTS_PER_PROMPT, 1)
    if seed + count - 1 > limits.SEED_MAX:
        raise RequestError(
            "num_outputs",
            f"output i runs at seed + i: {count} outputs from seed {seed} pass the largest seed {limits.SEED_MAX}",
        )
    return count


def _adapter_pin(request: GenerationRequest, task: str, defaults: ModelDefaults) -> ModelDefaults:
    """The defaults under the request's adapter: a Turbo LoRA pins its forward count and shifts (its file name's
    contract); a server with a fused FastH3 adapter already pins its schedule and serves T2VA without `lora`."""
    if defaults.distilled_checkpoint is not None:
        if task not in FASTH3_TASKS:
            raise RequestError("task", f"this server runs the {defaults.distilled_checkpoint} checkpoint, which "
                                       f"serves {', '.join(FASTH3_TASKS)} only, not {task}")
        if request.lora is not None:
            raise RequestError("lora", f"this server runs the {defaults.distilled_checkpoint} checkpoint; a LoRA "
                                       "cannot run on it")
    if defaults.fused_adapter is not None:
        if task not in FASTH3_TASKS:
            raise RequestError(
                "task",
                f"this server fuses the FastH3 adapter {defaults.fused_adapter}, which serves "
                f"{', '.join(FASTH3_TASKS)} only, not {task}",
            )
        if request.lora is not None:
            raise RequestError(
                "lora",
                f"this server fuses the FastH3 adapter {defaults.fused_adapter}; a per-request "
                "LoRA cannot run on top of it",
            )
    lora = request.lora
    if lora is not None and lora.flashgen is not None:
        if defaults.pinned_schedule is not None:
            raise RequestError("lora", f"{lora.name} is a FlashGen LoRA with its own base schedule; this server's "
                                       f"checkpoint already pins one ({defaults.pinned_schedule.owner})")
        return dataclasses.replace(defaults, pinned_schedule=flashgen_pin(lora.flashgen, lora.name, task))
    if lora is not None and lora.pdd is not None:
        return dataclasses.replace(defaults, pinned_schedule=pdd_pin(lora.pdd, lora.name, task, lora.scale))
    if lora is None or lora.turbo is None:
        return defaults
    return dataclasses.replace(defaults, pinned_schedule=turbo_pin(lora.turbo, lora.name, task))


def _resolve_schedule(request: GenerationRequest, defaults: ModelDefaults) -> tuple[int, float, float]:
    """(steps, flow_shift, audio_flow_shift): the forward count and both shifts, under any pinned schedule."""
    pin = defaults.pinned_schedule
    steps = resolve_steps(request.steps, pin)
    pinned = [resolve_pinned_shift(name, getattr(request, name), pin) for name in ("flow_shift", "audio_flow_shift")]
    flow_shift = (
        pinned[0] if pinned[0] is not None else _check_shift("flow_shift", request.flow_shift, defaults.flow_shift)
    )
    audio = (
        pinned[1]
        if pinned[1] is not None
        else _check_shift("audio_flow_shift", request.audio_flow_shift, defaults.audio_flow_shift)
    )
    return steps, flow_shift, audio


def resolve_sample_solver(value: object, pin: PinnedSchedule | None) -> SampleSolver:
    """The solver a request runs: `euler` (default) or `res_multistep`, any case, surrounding spaces ignored.

    Under a pinned schedule (a few-step adapter: Turbo, FastH3) only Euler: the student was distilled to land on
    its pinned grid with Euler steps, and a second-order step extrapolates across its jumps."""
    if value is None:
        return DEFAULT_SAMPLE_SOLVER
    if not isinstance(value, str):
        raise RequestError("sample_solver", f"must be a string, one of {', '.join(SAMPLE_SOLVERS)}; got {shown(value)}")
    name = value.strip().lower()
    if name not in SAMPLE_SOLVERS:
        raise RequestError("sample_solver", f"must be one of {', '.join(SAMPLE_SOLVERS)}, got {shown(value)}")
    if pin is not None and name != DEFAULT_SAMPLE_SOLVER:
        raise RequestError(
            "sample_solver",
            f"{pin.owner} runs its pinned {pin.forwards}-step schedule with the {DEFAULT_SAMPLE_SOLVER} solver "
            f"only; omit the field or send {DEFAULT_SAMPLE_SOLVER}, got {shown(value)}",
        )
    return cast(SampleSolver, name)


def _check_quality(quality: str | None) -> str | None:
    if quality not in (None, *QUALITIES):
        raise RequestError("quality", f"must be one of {', '.join(QUALITIES)}, got {shown(quality)}")
    return quality


def check_prompt(prompt: object, field: str = "prompt") -> str:
    """The prompt, or a RequestError naming `field` (not a string, empty, over the limit)."""
    if not isinstance(prompt, str):
        raise RequestError(field, "must be a string")
    if not prompt.strip():
        raise RequestError(field, "must not be empty")
    if len(prompt) > limits.MAX_PROMPT_CHARS:
        raise RequestError(field, f"is {len(prompt)} characters long; the limit is {limits.MAX_PROMPT_CHARS}")
    return prompt


def check_int(field: str, value: object, lo: int, hi: int, default: int) -> int:
    """`value` as an integer in [lo, hi] (`default` when None), or a RequestError naming `field`."""
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(field, f"must be an integer, got {shown(value)}")
    if not lo <= value <= hi:
        raise RequestError(field, f"must be between {lo} and {hi}, got {shown(value)}")
    return value


def _check_shift(field: str, value: object, default: float) -> float:
    if value is None:
        return float(default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise RequestError(field, f"must be a finite number, got {shown(value)}")
    if not 0 < value <= limits.MAX_FLOW_SHIFT:
        raise RequestError(field, f"must be greater than 0 and at most {limits.MAX_FLOW_SHIFT:g}, got {value:g}")
    return float(value)


def _resolve_size(
    request: GenerationRequest, defaults: ModelDefaults, task: str, keyframe_size: tuple[int, int] | None
) -> tuple[int, int]:
    """(height, width) by the canvas rule (h3serve/rules/canvas.py)."""
    try:
        return resolve_canvas(
            defaults, task, request.width, request.height, request.aspect_ratio, request.short_edge, keyframe_size
        )
    except CanvasError as e:
        raise RequestError(e.field, e.message) from None
