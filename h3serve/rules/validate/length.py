"""The rules of a request's length: its frame count (from a duration or num_frames), the long-video mode and a
continuation's windows with their prompts."""

from __future__ import annotations

import math

from h3serve.errors import RequestError
from h3serve.rules import geometry, limits
from h3serve.rules.long_video import MODES, Window, max_duration_s, on_frame_grid, plan_windows, window_fits
from h3serve.rules.request import GenerationRequest
from h3serve.rules.shown import shown

_CONTINUATION_FIELDS = ("continuation_window_frames", "continuation_overlap_frames", "continuation_prompts")


def resolve_long_video_mode(request: GenerationRequest, task: str) -> str | None:
    """None without `long_video`; else the mode (default: continuation for ref2va, full otherwise)."""
    long_video, mode = request.long_video, request.long_video_mode
    if long_video is not None and not isinstance(long_video, bool):
        raise RequestError("long_video", f"must be a boolean, got {shown(long_video)}")
    if mode is not None and mode not in MODES:
        raise RequestError("long_video_mode", f"must be full or continuation, got {shown(mode)}")
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


def resolve_frames(request: GenerationRequest, mode: str | None = None) -> int:
    lo, hi = limits.MIN_DURATION_S, max_duration_s(mode)
    frames_from_duration = None
    if request.duration_s is not None:
        d = request.duration_s
        if isinstance(d, bool) or not isinstance(d, int | float) or not math.isfinite(d):
            raise RequestError("duration", f"must be a number of seconds, got {shown(d)}")
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
        raise RequestError("num_frames", f"must be an integer, got {shown(n)}")
    if not lo_frames <= n <= hi_frames:
        raise RequestError(
            "num_frames",
            f"must be between {lo_frames} and {hi_frames} ({lo:g}-{hi:g} s at {limits.FPS} fps)"
            f"{_duration_hint(mode)}, got {shown(n)}",
        )
    snapped = geometry.snap_frames_up(n)
    if frames_from_duration is not None and frames_from_duration != snapped:
        raise RequestError(
            "num_frames",
            f"{n} frames ({snapped} after snapping) contradicts duration {request.duration_s:g} s "
            f"({frames_from_duration} frames); give one of them",
        )
    return snapped


def resolve_continuation(
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
                name, f"the continuation {what} must be an integer on the 17n+5 frame grid, got {shown(value)}"
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
            f"frames), got {shown(count)}",
        )
    combined = tuple(f"{request.prompt} {p}" for p in prompts)
    for i, text in enumerate(combined):
        if len(text) > limits.MAX_PROMPT_CHARS:
            raise RequestError(
                f"continuation_prompts[{i}]",
                f"with the main prompt is {len(text)} characters long; the limit is {limits.MAX_PROMPT_CHARS}",
            )
    return windows, (request.prompt,) * (len(windows) - generated) + combined
