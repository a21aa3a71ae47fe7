"""The create request's scalar fields as one pydantic model: it types and range-checks (coerces form strings,
refuses out-of-range values) and it is where the OpenAPI schema comes from, so the two cannot drift.

What a schema cannot say is listed in `CROSS_FIELD_RULES`: those are the only 400s a schema-valid request can get
(checked by a schemathesis test). Field names follow vLLM-Omni; media fields are read separately (request_fields).
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from h3serve import limits
from h3serve.api.coerce import as_json, preview
from h3serve.api.errors import APIError
from h3serve.canvas import SHORT_EDGE_MODES
from h3serve.names import AudioMode, LongVideoMode, Quality, Task

_NUMBER = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?")

_MIN_EDGE = limits.SPATIAL_MULTIPLE
_MAX_EDGE = limits.MAX_EDGE  # ModelDefaults.max_edge may be smaller: a documented rule
# The schema's bounds are the longest mode's (continuation); the per-mode caps are a cross-field rule.
_MAX_S = limits.MAX_CONTINUATION_DURATION_S
_LO_FRAMES, _HI_FRAMES = int(limits.MIN_DURATION_S * limits.FPS), int(_MAX_S * limits.FPS)

Seconds = Annotated[float, Field(ge=limits.MIN_DURATION_S, le=_MAX_S, allow_inf_nan=False)]
StartTime = Annotated[float, Field(ge=0, le=3600, allow_inf_nan=False)]
GridFrames = Annotated[int, Field(ge=limits.MIN_OVERLAP_FRAMES, le=limits.MAX_WINDOW_FRAMES)]
Shift = Annotated[float, Field(gt=0, le=limits.MAX_FLOW_SHIFT, allow_inf_nan=False)]
_RATIO_NUMBER = r"\d{1,3}(\.\d{1,6})?"
# W:H (or WxH, W/H), one number (W/H), or auto/adaptive; a JSON number is a ratio too. The canvas rule is
# h3serve/canvas.py (and CANVAS_RULE below, which the OpenAPI description states).
Ratio = (
    Annotated[str, Field(pattern=rf"^\s*(?:(?i:auto|adaptive)|{_RATIO_NUMBER}(?:\s*[:xX/]\s*{_RATIO_NUMBER})?)\s*$")]
    | Annotated[float, Field(gt=0, le=1000, allow_inf_nan=False)]
)
ShortEdge = Annotated[int, Field(ge=1, le=_MAX_EDGE, json_schema_extra={"enum": list(SHORT_EDGE_MODES)})]
CANVAS_RULE = (
    "Canvas: `size` / `width`+`height` are floored to multiples of 32 and generated as given. `aspect_ratio` is "
    "W:H (16:9, 21:9, 4:3, 1:1, 3:4, 9:16 or any W:H from 1:4 to 4:1), a number (1.7778) or auto/adaptive (FL2VA: "
    "its first keyframe's aspect; Ref2VA: 16:9; T2VA: the checkpoint's default canvas, 16:9). Beside a size, "
    "aspect_ratio must describe the same canvas after the flooring (W/(H+32) <= ratio <= (W+32)/H), else 400 "
    "naming both. `short_edge` 768 or 1440 picks the model card's canvas mode (768: the checkpoint's canvas, "
    "1344x768 at 16:9; 1440: both edges scaled by 1440/768, 2528x1440 at 16:9); beside a size it must give that "
    "size. Without a size: the canvas for the ratio (the request's, else the keyframe's for FL2VA, else 16:9)."
)
Edge = Annotated[int, Field(ge=_MIN_EDGE, le=_MAX_EDGE)]
FrameIndex = Literal[0, -1]

# 400s a schema-valid request can still get: rules between fields, or about this server and its checkpoint.
CROSS_FIELD_RULES: dict[str, str] = {
    "ratio": "the canvas (size, width/height or aspect_ratio) must be between 1:4 and 4:1",
    "together": "width and height are given together; aspect_ratio / short_edge beside them must describe the same "
    "canvas after flooring to multiples of 32 (CANVAS_RULE)",
    "frames": "num_frames and a duration must agree (17n+5 frames after snapping)",
    "edges": "size edges are 32 to the checkpoint's max_edge after flooring to multiples of 32",
    "cost": "width x height x frames x steps must be within --max-request-cost (code request_too_costly)",
    "model": "model, if given, is the served model's name",
    "task": "extra_params.task must agree with the media sent (fl2va: keyframes; ref2va: references)",
    "frame_indices": "frame_indices only with fl2va keyframe images, one index per image",
    "media_mix": "input_reference(s) stand alone (not with image_reference or video_reference); 12 files at most",
    "media": "media must be fetchable and decode as the declared kind within the model card's limits",
    "prompt": "the prompt must hold non-whitespace, valid Unicode text",
    "long_video": "durations: 4-15 s, with long_video=true up to 30 s (long_video_mode=full) or 300 s "
    "(continuation, ref2va only); continuation_* only with continuation: window and overlap on the 17n+5 grid, "
    "window 107..345 frames and longer than the overlap, one continuation prompt per window, not with quality=high",
    "edit": "source_video / source_audio need a video_noise_mask / audio_noise_mask (masks in [0, 1] on the latent "
    "grid, not with an extension); audio_mode=lock_source needs exactly one driving audio and no audio mask; "
    "start_time_seconds only for ref2va, one value or one per video reference, inside each video with 2 s after",
    "video": "edits and extensions take one `video`: a video file or {\"id\": ...} of a completed video of this "
    "server (an unknown id is 404, an unfinished one 409), and no other media field",
    "required": "a remix or an edit needs a prompt, an extension also `seconds` (code missing_field)",
    "lora": "lora names one adapter: a name preloaded with --lora-path (GET /v1/models lists them) or a path under "
    "--lora-dir (no `..`, nothing outside it); its aliases (name/lora_name/adapter, path/lora_path/local_path, "
    "scale/lora_scale, int_id/lora_int_id) must agree; a Turbo adapter fixes the steps and shifts of its contract "
    "and the tasks it serves",
}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Target(_Strict):
    duration_seconds: Seconds | None = None
    aspect_ratio: Ratio | None = None
    short_edge: ShortEdge | None = None
    frame_indices: Annotated[list[FrameIndex], Field(min_length=1, max_length=2)] | FrameIndex | None = None


class LongVideoFields(_Strict):
    """Long video options (h3serve/long_video.py), accepted at the top level and in extra_params."""

    long_video: bool | None = Field(None, description="allow up to 30 s (full) or 300 s (continuation)")
    long_video_mode: LongVideoMode | None = Field(
        None, description="full: one pass; continuation: overlapping windows (default for ref2va)"
    )
    continuation_window_frames: GridFrames | None = Field(None, description="17n+5, 107-345 (default 277)")
    continuation_overlap_frames: GridFrames | None = Field(None, description="17n+5, below the window (default 22)")
    continuation_prompts: Annotated[list[str], Field(min_length=1, max_length=200)] | None = Field(
        None, description="one per window, each appended to the main prompt for its window"
    )

    @field_validator("continuation_prompts", mode="before")
    @classmethod
    def _json_list(cls, value: Any) -> Any:
        if isinstance(value, str) and not value.lstrip().startswith("["):
            return [value]  # one window's prompt as a plain form field
        return as_json(value, "continuation_prompts")  # a form field carries the list as JSON text


class EditOptions(_Strict):
    """Latent-mask editing options besides the uploads (source_video, source_audio, *_noise_mask: media fields)."""

    audio_mode: AudioMode | None = Field(
        None, description="lock_source: the one driving audio (source_audio or an audio reference) is the soundtrack"
    )
    start_time_seconds: StartTime | Annotated[list[StartTime], Field(min_length=1, max_length=3)] | None = Field(
        None, description="ref2va: trim reference videos before this time (one, or one per video)"
    )


class ExtraParams(LongVideoFields, EditOptions):
    task: Task | None = None
    duration: Seconds | None = None
    duration_seconds: Seconds | None = None
    aspect_ratio: Ratio | None = None
    short_edge: ShortEdge | None = None
    flow_shift: Shift | None = None
    audio_flow_shift: Shift | None = None
    frame_indices: Annotated[list[FrameIndex], Field(min_length=1, max_length=2)] | FrameIndex | None = None
    frame_index: FrameIndex | None = None
    target: Target | None = None


AdapterText = Annotated[str, Field(min_length=1, max_length=4096, pattern=r"^[^\x00]*$")]


class LoraObject(BaseModel):
    """vLLM-Omni's `lora` object (h3serve.adapters.catalog.parse_lora_field checks it; aliases in brackets)."""

    model_config = ConfigDict(extra="forbid")
    name: AdapterText | None = Field(None, description="a preloaded adapter (GET /v1/models) [lora_name, adapter]")
    lora_name: AdapterText | None = None
    adapter: AdapterText | None = None
    path: AdapterText | None = Field(None, description="a file or folder under --lora-dir [lora_path, local_path]")
    lora_path: AdapterText | None = None
    local_path: AdapterText | None = None
    scale: Annotated[float, Field(ge=-10, le=10)] | None = Field(None, description="times alpha / rank [lora_scale]")
    lora_scale: Annotated[float, Field(ge=-10, le=10)] | None = None
    int_id: Annotated[int, Field(ge=0)] | None = Field(None, description="[lora_int_id]")
    lora_int_id: Annotated[int, Field(ge=0)] | None = None


class VideoCreateFields(LongVideoFields, EditOptions):
    """The scalar fields of POST /v1/videos (and /sync)."""

    prompt: Annotated[str, Field(min_length=1, max_length=limits.MAX_PROMPT_CHARS, pattern=r"\S")]
    model: str | None = None
    seconds: Seconds | None = Field(
        None, description="4 to 15 (30 or 300 with long_video); snapped up to a 17n+5 frame count"
    )
    size: Annotated[str, Field(pattern=r"^\s*\d{1,6}\s*[xX]\s*\d{1,6}\s*$")] | None = Field(
        None, description="WIDTHxHEIGHT; each edge floored to a multiple of 32 (1280x720 -> 1280x704)"
    )
    width: Edge | None = None
    height: Edge | None = None
    num_frames: Annotated[int, Field(ge=_LO_FRAMES, le=_HI_FRAMES)] | None = None
    fps: Annotated[float, Field(ge=limits.FPS, le=limits.FPS)] | None = None
    aspect_ratio: Ratio | None = Field(None, description=CANVAS_RULE)
    short_edge: ShortEdge | None = Field(None, description="768 or 1440: the model card's canvas mode")
    num_inference_steps: Annotated[int, Field(ge=limits.MIN_STEPS, le=limits.MAX_STEPS)] | None = Field(
        None, description=f"denoiser forwards N (N + 1 sigma points; diffusers' num_inference_steps = N + 1); "
                          f"default {limits.DEFAULT_STEPS}; an adapter with a pinned schedule takes its own count")
    flow_shift: Shift | None = None
    # The schema states the largest float64 below 2**63: JSON tools that read numbers as doubles would round
    # SEED_MAX (2**63 - 1) up to 2**63 and send it as "valid"; the server itself accepts up to SEED_MAX.
    seed: Annotated[int, Field(ge=limits.SEED_MIN, le=limits.SEED_MAX,
                               json_schema_extra={"maximum": 2**63 - 1024})] | None = None
    user: str | None = None
    num_outputs_per_prompt: Annotated[int, Field(ge=1, le=1)] | None = None
    quality: Quality | None = Field(
        None, description="DiT cache policy: lossless (no cache) or high (the built-in cache profile)"
    )
    extra_params: ExtraParams | None = None
    lora: LoraObject | None = Field(None, description="a LoRA adapter for this request (applied unmerged)")

    @field_validator("extra_params", "lora", mode="before")
    @classmethod
    def _json_text(cls, value: Any, info: Any) -> Any:
        return as_json(value, info.field_name)  # a form field carries the object as JSON text


SCALAR_FIELDS = tuple(VideoCreateFields.model_fields)
_EXAMPLES = {"size": "1344x768 (WIDTHxHEIGHT)", "aspect_ratio": "16:9 (W:H), a number such as 1.7778, or auto"}


def _bounds(loc: tuple[Any, ...]) -> str | None:
    """'between A and B' from the schema of the field at `loc`, for range errors."""
    schema: dict[str, Any] = VideoCreateFields.model_json_schema()
    node: dict[str, Any] = schema
    for part in loc:
        if isinstance(part, int):
            continue
        node = node.get("properties", {}).get(part) or node
        node = schema["$defs"].get(node.get("$ref", "").split("/")[-1], node) if "$ref" in node else node
        for option in node.get("anyOf", ()):
            option = schema["$defs"].get(option.get("$ref", "").split("/")[-1], option) if "$ref" in option else option
            if "minimum" in option or "exclusiveMinimum" in option or "properties" in option:
                node = option
    lo, hi = node.get("minimum", node.get("exclusiveMinimum")), node.get("maximum")
    return None if lo is None or hi is None else f"between {lo:g} and {hi:g}"


def _shown(raw: Any) -> str:
    """The offending value as the client wrote it: a form field's "500" reads 500, not '500'."""
    if isinstance(raw, str) and _NUMBER.fullmatch(raw.strip()):
        text = raw.strip()
        return text if len(text) <= 40 else f"{text[:37]}..."
    return preview(raw)


def _message(error: dict[str, Any]) -> str:
    value = _shown(error.get("input"))
    kind = error["type"]
    if error["loc"] == ("prompt",) and kind in ("string_too_short", "string_pattern_mismatch"):
        return "must not be empty"
    if kind.startswith("int_") and kind != "int_from_float" or kind == "int_from_float":
        return f"must be an integer, got {value}"
    if kind in ("float_parsing", "float_type", "finite_number"):
        return f"must be a finite number, got {value}"
    if kind in ("greater_than_equal", "less_than_equal", "greater_than", "less_than"):
        bounds = _bounds(tuple(error["loc"]))
        return f"must be {bounds}, got {value}" if bounds else f"{error['msg'].lower()}, got {value}"
    if kind == "string_pattern_mismatch":
        example = _EXAMPLES.get(str(error["loc"][-1]), "the documented form")
        return f"must look like {example}, got {value}"
    return f"{error['msg'][0].lower()}{error['msg'][1:]}, got {value}"


def coerce_fields(fields: dict[str, Any]) -> dict[str, Any]:
    """The scalar fields typed and range-checked (unset ones left out); 400 naming the first bad field."""
    try:
        model = VideoCreateFields.model_validate({k: v for k, v in fields.items() if k in SCALAR_FIELDS})
    except ValidationError as e:
        # Union members each report; the most specific error is the one with the longest location.
        error = max(e.errors(), key=lambda err: len([p for p in err["loc"] if isinstance(p, str)]))
        param = ".".join(str(p) for p in error["loc"] if not _is_union_tag(p))
        raise APIError(400, f"{param}: {_message(error)}", "invalid_value", param) from None
    return model.model_dump(exclude_unset=True)


def _is_union_tag(part: Any) -> bool:
    """pydantic names union members in error locations (`list[...]`, `literal[...]`): not field names."""
    return isinstance(part, str) and (
        "[" in part or part in ("int", "float", "str", "bool") or part.startswith("constrained-")
    )
