"""The rules of a real-time session's settings (`session.start`): one `RealtimePlan`, or a `RequestError` naming
the field and the limit. What TaoMate-H3 does not do is refused with the reason, as vLLM-Omni refuses it: other
tasks than T2VA (keyframes, references), several outputs, another frame rate, another schedule or adapter."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from h3serve.errors import RequestError
from h3serve.rules import limits
from h3serve.rules.defaults import ModelDefaults
from h3serve.rules.realtime_geometry import STUDENT_STEPS, chunks_for_frames
from h3serve.rules.shown import shown
from h3serve.rules.validate.resolve import check_int, check_prompt

_TASKS = ("t2va",)  # the streaming LoRA was distilled on the FL2VA DiT's text-to-video-and-audio task
_MEDIA_KEYS = ("image", "image_reference", "input_reference", "last_image", "references", "reference_images",
               "reference_videos", "reference_audios", "video", "audio", "multi_modal_data", "control")
_SCHEDULE_KEYS = ("num_inference_steps", "steps", "flow_shift", "audio_flow_shift", "sample_solver", "sigmas")


@dataclass(frozen=True)
class RealtimePlan:
    """A validated session: its first prompt, canvas, seed, the frames asked for and the chunks that cover them."""

    prompt: str
    width: int
    height: int
    seed: int
    num_frames: int
    chunks: int


def plan_realtime(
    prompt: object,
    width: object,
    height: object,
    seed: object,
    num_frames: object,
    negative_prompt: object = None,
    extra: Mapping[str, Any] | None = None,
    defaults: ModelDefaults | None = None,
) -> RealtimePlan:
    """Check a session's settings (`extra`: its sampling_params / extra_params as given) against the limits and
    the checkpoint's `defaults`."""
    defaults = defaults or ModelDefaults()
    text = check_prompt(prompt)
    if negative_prompt not in (None, ""):
        raise RequestError("negative_prompt", "is not supported: the streaming LoRA is CFG-distilled (no guidance)")
    w, h = (_check_edge(name, value, defaults) for name, value in (("width", width), ("height", height)))
    short, allowed = min(w, h), sorted({*limits.REALTIME_SHORT_EDGES, defaults.canvas_short_edge})
    if short not in allowed:
        raise RequestError("width" if w <= h else "height",
                           f"the short edge must be one of {', '.join(map(str, allowed))}, got {short}")
    if max(w, h) > limits.MAX_ASPECT_RATIO * short:
        raise RequestError("width" if w > h else "height", f"{w}x{h} is wider than 4:1")
    if seed is None:  # required here: check_int would take its default
        raise RequestError("seed", "must be an integer, got None")
    seed = check_int("seed", seed, limits.SEED_MIN, limits.SEED_MAX, 0)
    frames = check_int("num_frames", num_frames, 1, limits.MAX_REALTIME_FRAMES, limits.MAX_REALTIME_FRAMES)
    _check_extra(dict(extra or {}))
    return RealtimePlan(text, w, h, seed, frames, chunks_for_frames(frames))


def _check_edge(field: str, value: object, defaults: ModelDefaults) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(field, f"must be an integer number of pixels, got {shown(value)}")
    if value <= 0 or value % limits.SPATIAL_MULTIPLE or value > defaults.max_edge:
        raise RequestError(field, f"must be a positive multiple of {limits.SPATIAL_MULTIPLE} up to "
                                  f"{defaults.max_edge}, got {shown(value)}")
    return value


def _check_extra(extra: dict[str, Any]) -> None:
    """The sampling parameters that contradict a real-time session; any other is ignored, as vLLM-Omni does."""
    for key in ("num_outputs_per_prompt", "num_videos_per_prompt", "n"):
        if extra.get(key) not in (None, 1):
            raise RequestError(key, f"a session is one stream; must be 1, got {shown(extra[key])}")
    task = extra.get("task", extra.get("task_type"))
    if task is not None and str(task).lower() not in _TASKS:
        raise RequestError("task", f"real-time sessions serve {', '.join(_TASKS)} only (the streaming LoRA's task), "
                                   f"got {shown(task)}")
    for key in _MEDIA_KEYS:
        if extra.get(key) not in (None, "", [], {}):
            raise RequestError(key, "real-time sessions are text-to-video-and-audio only: no keyframes, references "
                                    "or control media")
    fps = extra.get("fps")
    if fps is not None and fps != limits.FPS:
        raise RequestError("fps", f"real-time sessions run at {limits.FPS} fps, got {shown(fps)}")
    for key in _SCHEDULE_KEYS:
        if extra.get(key) is not None:
            raise RequestError(key, f"the streaming LoRA's schedule is fixed ({STUDENT_STEPS} Euler steps per chunk); "
                                    "leave it out")
    if extra.get("lora") is not None:
        raise RequestError("lora", "a session runs the server's --realtime-lora; no other adapter")
