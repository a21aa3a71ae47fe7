"""The create request's fields as one pydantic model: it types and range-checks (coerces form strings, refuses
out-of-range values), it is where the OpenAPI schema comes from, so the two cannot drift, and it yields the one
`GenerationRequest` (`to_request`) that every entry point builds.

What a schema cannot say is listed in `CROSS_FIELD_RULES`: those are the only 400s a schema-valid request can get
(checked by a schemathesis test). Field names follow vLLM-Omni: `extra_params` keys win over top-level fields, and
`extra_params.target` over `extra_params` (`ALIASES`). Media files are read separately (media_fields) and placed
on the request by media_routing.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal, Self

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ModelWrapValidatorHandler,
    PrivateAttr,
    field_validator,
    model_validator,
)
from pydantic.json_schema import SkipJsonSchema

from h3serve.adapters.catalog import INT_ID_MAX, SCALE_LIMIT, LoraField, parse_lora_field
from h3serve.api.error_envelope import bad_request
from h3serve.api.intake.json_values import as_json
from h3serve.errors import RequestError
from h3serve.rules import limits
from h3serve.rules.canvas import SHORT_EDGE_MODES
from h3serve.rules.names import (
    DEFAULT_SAMPLE_SOLVER,
    SAMPLE_SOLVERS,
    AudioMode,
    LongVideoMode,
    Quality,
    RefreshPolicy,
    Task,
    X264Preset,
)
from h3serve.rules.request import GenerationRequest

_SIZE_PATTERN = r"^\s*\d{1,6}\s*[xX]\s*\d{1,6}\s*$"

_MIN_EDGE = limits.SPATIAL_MULTIPLE
_MAX_EDGE = limits.MAX_EDGE  # ModelDefaults.max_edge may be smaller: a documented rule
# The schema's bounds are the longest mode's (continuation); the per-mode caps are a cross-field rule.
_MAX_S = limits.MAX_CONTINUATION_DURATION_S
_LO_FRAMES, _HI_FRAMES = int(limits.MIN_DURATION_S * limits.FPS), int(_MAX_S * limits.FPS)

Seconds = Annotated[float, Field(ge=limits.MIN_DURATION_S, le=_MAX_S, allow_inf_nan=False)]


def _whole_number(value: Any) -> Any:
    """A float with no fractional part as the int it is (JSON Schema's integer includes 17.0)."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


# After a strict int's Field (the JSON-only extra_params fields): an integer as the schema says it, 17 or 17.0,
# never true or "17". (After the Field, so that the schema keeps its minimum and maximum.)
WHOLE_NUMBER = BeforeValidator(_whole_number)
StartTime = Annotated[float, Field(ge=0, le=3600, allow_inf_nan=False)]
# A continuation's window and overlap, on the 17n+5 grid (a rule the schema states in words): the window 107..345,
# the overlap from 5 to the largest grid count below the longest window.
WindowFrames = Annotated[int, Field(ge=limits.MIN_WINDOW_FRAMES, le=limits.MAX_WINDOW_FRAMES)]
OverlapFrames = Annotated[int, Field(ge=limits.MIN_OVERLAP_FRAMES,
                                     le=limits.MAX_WINDOW_FRAMES - limits.VAE_FRAMES_PER_CHUNK)]
Shift = Annotated[float, Field(gt=0, le=limits.MAX_FLOW_SHIFT, allow_inf_nan=False)]
_RATIO_NUMBER = r"\d{1,3}(\.\d{1,6})?"
# W:H (or WxH, W/H), one number (W/H), or auto/adaptive; a JSON number is a ratio too. The canvas rule is
# h3serve/rules/canvas.py (and CANVAS_RULE below, which the OpenAPI description states).
Ratio = (
    Annotated[str, Field(pattern=rf"^\s*(?:(?i:auto|adaptive)|{_RATIO_NUMBER}(?:\s*[:xX/]\s*{_RATIO_NUMBER})?)\s*$")]
    | Annotated[float, Field(gt=0, le=1000, allow_inf_nan=False)]
)
ShortEdge = Annotated[int, Field(ge=min(SHORT_EDGE_MODES), le=max(SHORT_EDGE_MODES),
                                 json_schema_extra={"enum": list(SHORT_EDGE_MODES)})]
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
# A solver name in any case with surrounding whitespace (vLLM-Omni trims and lower-cases it): a pattern rather than
# an enum, so that the schema admits exactly what the server accepts; validation normalises it.
SolverName = Annotated[str, Field(pattern=rf"^\s*(?i:{'|'.join(SAMPLE_SOLVERS)})\s*$")]
SOLVER_RULE = (
    f"the sampler: {DEFAULT_SAMPLE_SOLVER} (default) or res_multistep (ComfyUI's second-order RES multistep, one "
    "solver state per modality on its own sigmas; its first step and the step to sigma 0 are Euler, so 1 or 2 steps "
    f"equal {DEFAULT_SAMPLE_SOLVER}); any case, surrounding spaces ignored. A few-step adapter (Turbo LoRA, fused "
    f"FastH3) runs {DEFAULT_SAMPLE_SOLVER} only"
)
FrameIndex = Literal[0, -1]
Outputs = Annotated[int, Field(ge=1, le=limits.MAX_OUTPUTS_PER_PROMPT)]
OUTPUTS_RULE = (
    f"outputs of this prompt, 1 to {limits.MAX_OUTPUTS_PER_PROMPT} (default 1): output i is exactly the request at "
    "seed + i. The job lists each (`outputs`: index and URL); GET /v1/videos/{id}/content?index=i downloads it; the "
    "sync route returns output 0 and says how many there were in X-Num-Outputs. A job of N costs N toward "
    "--max-request-cost and --max-queue"
)

# 400s a schema-valid request can still get: rules between fields, or about this server and its checkpoint.
CROSS_FIELD_RULES: dict[str, str] = {
    "ratio": "the canvas (size, width/height or aspect_ratio) must be between 1:4 and 4:1",
    "together": "width and height are given together; aspect_ratio / short_edge beside them must describe the same "
    "canvas after flooring to multiples of 32 (CANVAS_RULE)",
    "frames": "num_frames and a duration must agree (17n+5 frames after snapping)",
    "edges": "size edges are 32 to the checkpoint's max_edge after flooring to multiples of 32",
    "cost": "width x height x frames x steps x outputs must be within --max-request-cost (code request_too_costly)",
    "outputs": "num_outputs_per_prompt (or n): output i runs at seed + i, so seed + outputs - 1 must be a valid seed",
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
    "form_json": "in a form, extra_params is JSON text, and continuation_prompts sent as one value starting with `[` "
    "is read as a JSON list: either must then parse (code invalid_json)",
    "control": "one control type per request, with its media (inpaint: a mask; the others: a control video; a "
    "source only with a mask), paths under --control-dir, T2VA only, on a server with --controlnet-model-path; "
    "control media decode within the pixel budget (frames and masks at most 4096x2304 pixels)",
    "guides": "timeline_guides: each frame_index places its guide inside the output (a clip keeps 1 or 5+17k frames), "
    "each upload_index names a guide_files upload of that kind and every upload is used; not with quality=high, a "
    "server cache with quality omitted, a distilled adapter, a continuation, an edit or a control video",
    "lora": "lora names one adapter: a name preloaded with --lora-path (GET /v1/models lists them) or a path under "
    "--lora-dir (no `..`, nothing outside it); its aliases (name/lora_name/adapter, path/lora_path/local_path, "
    "scale/lora_scale, int_id/lora_int_id) must agree; a Turbo adapter fixes the steps and shifts of its contract "
    f"and the tasks it serves, and runs extra_params.sample_solver {DEFAULT_SAMPLE_SOLVER} only",
    "force_refresh": "extra_params.force_refresh_step_hint is at most the request's num_inference_steps, "
    "force_refresh_step_policy needs a hint, and both need a DiT cache active for the request (quality=high, or "
    "quality omitted on a server with --cache-backend cache_dit, or tea_cache for T2VA/FL2VA)",
}
REFRESH_RULE = (
    "vLLM-Omni's forced DiT-cache refresh: after this many denoiser forwards the request's cache (Cache-DiT or "
    "TeaCache) starts afresh as if a new generation began (its warm-up computes again); a strict integer from 1 "
    "to num_inference_steps"
)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Target(_Strict):
    duration_seconds: Seconds | None = None
    aspect_ratio: Ratio | None = None
    short_edge: ShortEdge | None = None
    frame_indices: Annotated[list[FrameIndex], Field(min_length=1, max_length=2)] | FrameIndex | None = None


class LongVideoFields(_Strict):
    """Long video options (h3serve/rules/long_video.py), accepted at the top level and in extra_params."""

    long_video: bool | None = Field(None, description="allow up to 30 s (full) or 300 s (continuation)")
    long_video_mode: LongVideoMode | None = Field(
        None, description="full: one pass; continuation: overlapping windows (default for ref2va)"
    )
    continuation_window_frames: WindowFrames | None = Field(None, description="17n+5, 107-345 (default 277)")
    continuation_overlap_frames: OverlapFrames | None = Field(None, description="17n+5, below the window "
                                                                                "(default 22)")
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


ControlPath = Annotated[str, Field(min_length=1, max_length=4096, pattern=r"^[^\x00]*$")]
CONTROL_RULE = (
    "a control video for the ControlNet branch (a server started with --controlnet-model-path): one control type "
    "per request; control_path / source_path / mask_path are files under the server's --control-dir (or upload "
    "control_reference / source_reference / mask_reference); inpaint needs a mask, the other types a control "
    f"video, a source a mask; control_context_scale 0 to {limits.MAX_CONTROL_SCALE:g} (default 1; 0: no control, "
    "the base output); T2VA only"
)


class ControlObject(BaseModel):
    """One control type's settings (vLLM-Omni's keys)."""

    model_config = ConfigDict(extra="forbid")
    control_path: ControlPath | None = None
    source_path: ControlPath | None = None
    mask_path: ControlPath | None = None
    control_context_scale: Annotated[float, Field(ge=0, le=limits.MAX_CONTROL_SCALE, allow_inf_nan=False)] | None = None


class ControlTypes(BaseModel):
    """The ControlNet Union's control types, each an `extra_params` key (at most one per request)."""

    canny: ControlObject | None = Field(None, description=CONTROL_RULE)
    depth: ControlObject | None = Field(None, description=CONTROL_RULE)
    hed: ControlObject | None = Field(None, description=CONTROL_RULE)
    mlsd: ControlObject | None = Field(None, description=CONTROL_RULE)
    pose: ControlObject | None = Field(None, description=CONTROL_RULE)
    inpaint: ControlObject | None = Field(None, description=CONTROL_RULE)


class VideoCodecOptions(_Strict):
    """vLLM-Omni's `video_codec_options`: the H.264 encoder's settings for this request (NVENC: crf is its QP)."""

    preset: X264Preset | None = Field(None, description="x264 preset (default: the server's --x264-preset)")
    crf: Annotated[int, Field(strict=True, ge=0, le=51), WHOLE_NUMBER] | None = Field(
        None, description="constant rate factor, 0 (lossless) to 51 (default: the server's --crf)"
    )


PREENCODE_RULE = (
    "vLLM-Omni's pre-encode: the MP4 is encoded while the VAE decodes (always so with --decode-mode stream; "
    "accepted either way). With preencode_mp4 true, preencode_batch_frames (a positive integer, default 17) is how "
    "many decoded frames the encoder takes at once (whole VAE clips, never split)"
)


class PreencodeFields(_Strict):
    preencode_mp4: Annotated[bool, Field(strict=True)] | None = Field(None, description=PREENCODE_RULE)
    preencode_batch_frames: Annotated[int, Field(strict=True, ge=1, le=_HI_FRAMES), WHOLE_NUMBER] | None = Field(
        None, description=PREENCODE_RULE
    )
    video_codec_options: VideoCodecOptions | None = None


class ExtraParams(LongVideoFields, EditOptions, ControlTypes, PreencodeFields):
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
    sample_solver: SolverName | None = Field(None, description=SOLVER_RULE, examples=list(SAMPLE_SOLVERS))
    force_refresh_step_hint: Annotated[int, Field(strict=True, ge=1, le=limits.MAX_STEPS), WHOLE_NUMBER] | None = Field(
        None, description=REFRESH_RULE
    )
    force_refresh_step_policy: RefreshPolicy | None = Field(
        None, description="once (default): refresh after the hint's forwards only; repeat: after every hint forwards"
    )


AdapterText = Annotated[str, Field(min_length=1, max_length=4096, pattern=r"^[^\x00]*$")]
LoraScale = Annotated[float, Field(ge=-SCALE_LIMIT, le=SCALE_LIMIT, allow_inf_nan=False)]
LoraId = Annotated[int, Field(ge=0, le=INT_ID_MAX)]


class LoraObject(BaseModel):
    """vLLM-Omni's `lora` object (h3serve.adapters.catalog.parse_lora_field checks it; aliases in brackets)."""

    model_config = ConfigDict(extra="forbid")
    name: AdapterText | None = Field(None, description="a preloaded adapter (GET /v1/models) [lora_name, adapter]")
    lora_name: AdapterText | None = None
    adapter: AdapterText | None = None
    path: AdapterText | None = Field(None, description="a file or folder under --lora-dir [lora_path, local_path]")
    lora_path: AdapterText | None = None
    local_path: AdapterText | None = None
    scale: LoraScale | None = Field(None, description="times alpha / rank [lora_scale]")
    lora_scale: LoraScale | None = None
    int_id: LoraId | None = Field(None, description="[lora_int_id]")
    lora_int_id: LoraId | None = None


class VideoCreateFields(LongVideoFields, EditOptions):
    """The scalar fields of POST /v1/videos (and /sync)."""

    prompt: Annotated[str, Field(min_length=1, max_length=limits.MAX_PROMPT_CHARS, pattern=r"\S")]
    model: str | None = None
    seconds: Seconds | None = Field(
        None, description="4 to 15 (30 or 300 with long_video); snapped up to a 17n+5 frame count"
    )
    size: Annotated[str, Field(pattern=_SIZE_PATTERN)] | None = Field(
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
    # The schema states SEED_MAX as the integer it is (h3serve.api.openapi.exact_request_bodies keeps it one).
    seed: Annotated[int, Field(ge=limits.SEED_MIN, le=limits.SEED_MAX)] | None = None
    user: str | None = None
    num_outputs_per_prompt: Outputs | None = Field(None, description=OUTPUTS_RULE)
    n: Outputs | None = Field(None, description="num_outputs_per_prompt by its OpenAI name (the other wins if both)")
    quality: Quality | None = Field(
        None, description="DiT cache policy: lossless (no cache) or high (the built-in cache profile)"
    )
    extra_params: ExtraParams | None = None
    lora: LoraObject | None = Field(None, description="a LoRA adapter for this request (applied unmerged)")
    # Masks arrive as JSON values, JSON text or JSON files; the reader parses them (edit_mask.parse_mask_json).
    # The create body's schema leaves them out (the edit route's documents them).
    video_noise_mask: SkipJsonSchema[Any] = None
    audio_noise_mask: SkipJsonSchema[Any] = None
    _seconds_sent: str | None = PrivateAttr(None)

    @field_validator("extra_params", "lora", mode="before")
    @classmethod
    def _json_text(cls, value: Any, info: Any) -> Any:
        return as_json(value, info.field_name)  # a form field carries the object as JSON text

    @field_validator("num_outputs_per_prompt", "n", mode="before")
    @classmethod
    def _no_bool(cls, value: Any) -> Any:
        if isinstance(value, bool):  # pydantic would read true as 1
            raise ValueError(f"must be an integer from 1 to {limits.MAX_OUTPUTS_PER_PROMPT}, got {value}")
        return value

    @model_validator(mode="wrap")
    @classmethod
    def _keep_seconds_as_sent(cls, data: Any, handler: ModelWrapValidatorHandler[Self]) -> Self:
        """The job reports `seconds` as the client wrote it ("4.0" stays "4.0")."""
        fields = handler(data)
        sent = data.get("seconds") if isinstance(data, dict) else None
        fields._seconds_sent = sent.strip() if isinstance(sent, str) else None
        return fields

    def to_request(self) -> GenerationRequest:
        """The request these fields describe, without media (`media_routing.place_media` adds the files): each
        value from where it wins, lists as tuples, a numeric ratio as text, `size` as the edges on the grid."""
        values: dict[str, Any] = {name: getattr(self, name) for name in _PLAIN}
        for name, places in ALIASES.items():
            found = self._first(places)
            if found is not None:
                values[name] = tuple(found[1]) if isinstance(found[1], list) else found[1]
        if isinstance(values.get("aspect_ratio"), float):  # a JSON number is a ratio as well (1.7778)
            values["aspect_ratio"] = repr(values["aspect_ratio"])
        if self.size is not None:  # WIDTHxHEIGHT (the field's pattern)
            values["width"], values["height"] = (_on_grid(int(edge)) for edge in re.split("[xX]", self.size))
        else:
            values["width"], values["height"] = (None if v is None else _on_grid(v) for v in (self.width, self.height))
        return GenerationRequest(**values)

    def client_names(self) -> dict[str, str]:
        """How validation errors name a given field ("steps", "width") -> the field the client sent it in."""
        names = {_ERROR_NAMES.get(name, name): found[0] for name, places in ALIASES.items()
                 if (found := self._first(places)) is not None}
        if self.size is not None:
            names.update(width="size", height="size")
        return names

    def seconds_label(self) -> str | None:
        """The requested duration for the job's `seconds`: `seconds` as sent, else the winning duration's value;
        None when no duration is given."""
        found = self._first(ALIASES["duration_s"])
        if found is None:
            return None
        if found[0] == "seconds" and self._seconds_sent is not None:
            return self._seconds_sent
        return f"{found[1]:g}"

    def frame_indices(self) -> tuple[int, ...] | None:
        """Where FL2VA keyframe images go (0 first, -1 last), if the request says."""
        found = self._first(FRAME_INDICES)
        if found is None:
            return None
        return tuple(found[1]) if isinstance(found[1], list) else (found[1],)

    def lora_field(self) -> LoraField | None:
        """The `lora` object with vLLM-Omni's aliases resolved (400 when two of them disagree)."""
        try:
            return None if self.lora is None else parse_lora_field(self.lora.model_dump(exclude_unset=True))
        except RequestError as e:
            raise bad_request(str(e), e.field) from None

    def _first(self, places: tuple[str, ...]) -> tuple[str, Any] | None:
        """The first (dotted field name, value) of `places` that the client gave."""
        for place in places:
            value: Any = self
            for part in place.split("."):
                value = getattr(value, part, None) if value is not None else None
            if value is not None:
                return place, value
        return None


MASK_FIELDS = ("video_noise_mask", "audio_noise_mask")
SCALAR_FIELDS = tuple(name for name in VideoCreateFields.model_fields if name not in MASK_FIELDS)
_TARGET, _EXTRA = "extra_params.target.", "extra_params."
# GenerationRequest fields a client may give in several places (or under another name), the winner first.
ALIASES: dict[str, tuple[str, ...]] = {
    "duration_s": (f"{_TARGET}duration_seconds", f"{_EXTRA}duration_seconds", f"{_EXTRA}duration", "seconds"),
    "aspect_ratio": (f"{_TARGET}aspect_ratio", f"{_EXTRA}aspect_ratio", "aspect_ratio"),
    "short_edge": (f"{_TARGET}short_edge", f"{_EXTRA}short_edge", "short_edge"),
    "steps": ("num_inference_steps",),
    "flow_shift": (f"{_EXTRA}flow_shift", "flow_shift"),
    "audio_flow_shift": (f"{_EXTRA}audio_flow_shift",),
    "task": (f"{_EXTRA}task",),
    "sample_solver": (f"{_EXTRA}sample_solver",),
    "force_refresh_step_hint": (f"{_EXTRA}force_refresh_step_hint",),
    "force_refresh_step_policy": (f"{_EXTRA}force_refresh_step_policy",),
    "num_outputs": ("num_outputs_per_prompt", "n"),
    "preencode_mp4": (f"{_EXTRA}preencode_mp4",),
    "preencode_batch_frames": (f"{_EXTRA}preencode_batch_frames",),
    "video_preset": (f"{_EXTRA}video_codec_options.preset",),
    "video_crf": (f"{_EXTRA}video_codec_options.crf",),
    **{name: (f"{_EXTRA}{name}", name) for name in (*LongVideoFields.model_fields, *EditOptions.model_fields)},
}
FRAME_INDICES = (f"{_TARGET}frame_indices", f"{_EXTRA}frame_indices", f"{_EXTRA}frame_index")
_PLAIN = ("prompt", "num_frames", "seed", "quality", *MASK_FIELDS)  # one place, the request's own name
_ERROR_NAMES = {"duration_s": "duration"}  # how validation errors name a request field, where that differs


def _on_grid(pixels: int) -> int:
    """An explicit edge floored to the model's grid, as vLLM-Omni does (the OpenAI SDK's 1280x720 becomes
    1280x704); the job's `size` reports what is generated. Below one grid step the value is left for validation
    to refuse."""
    step = limits.SPATIAL_MULTIPLE
    return pixels - pixels % step if pixels >= step else pixels


