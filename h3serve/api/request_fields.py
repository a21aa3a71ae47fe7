"""The create request's fields, with vLLM-Omni's names and meanings, read into typed values.

Top-level fields: prompt, model, seconds, size, width, height, num_frames, fps, aspect_ratio, short_edge,
num_inference_steps, flow_shift, seed, user, num_outputs_per_prompt, extra_params, the long video options
(long_video, long_video_mode, continuation_window_frames, continuation_overlap_frames, continuation_prompts;
also accepted in extra_params, which wins), and the media fields
input_reference, input_references, image_reference, video_reference, audio_reference.
`extra_params` keys win over top-level fields (as in vLLM-Omni): task, duration, duration_seconds,
aspect_ratio, short_edge, flow_shift, audio_flow_shift, frame_indices, frame_index, and `target`
{duration_seconds, aspect_ratio, short_edge, frame_indices}. The canvas rule is h3serve/canvas.py. Anything
else is refused with a 400 that names it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from starlette.datastructures import UploadFile

from h3serve import limits
from h3serve.adapters.catalog import LoraField, parse_lora_field
from h3serve.api.body import RequestBody
from h3serve.api.coerce import (
    as_int,
    as_int_list,
    as_json,
    as_number,
    as_object,
    as_text,
    preview,
    reject_unknown,
)
from h3serve.api.errors import bad_request
from h3serve.api.request_model import (
    SCALAR_FIELDS,
    EditOptions,
    ExtraParams,
    LongVideoFields,
    Target,
    coerce_fields,
)
from h3serve.edit_mask import MaskError, parse_mask_json
from h3serve.request import MediaKind
from h3serve.validate import RequestError

_SIZE = re.compile(r"^\s*(\d{1,6})\s*[xX]\s*(\d{1,6})\s*$")
URL_PREFIXES = ("http://", "https://", "data:")

# Media fields: the kind each declares (None: a mixed upload list, typed from the bytes) and the URL key.
MEDIA_FIELDS: dict[str, tuple[MediaKind | None, str | None]] = {
    "input_reference": ("image", "image_url"),
    "input_references": (None, None),
    "image_reference": ("image", "image_url"),
    "video_reference": ("video", "video_url"),
    "audio_reference": ("audio", "audio_url"),
    "source_video": ("video", "video_url"),  # latent-mask editing sources (512 MiB each)
    "source_audio": ("audio", "audio_url"),
}
SOURCE_FIELDS = ("source_video", "source_audio")
MASK_FIELDS = ("video_noise_mask", "audio_noise_mask")  # JSON: a file upload, a form field, or a JSON value
EXTRA_KEYS = tuple(ExtraParams.model_fields)
LONG_VIDEO_KEYS = (*LongVideoFields.model_fields, *EditOptions.model_fields)
LIST_FIELDS = ("continuation_prompts", "start_time_seconds")  # lists: repeated form fields or `name[]` parts
TARGET_KEYS = tuple(Target.model_fields)
# vLLM-Omni fields this server refuses, with the reason (instead of ignoring them silently).
UNSUPPORTED: dict[str, str] = {
    "negative_prompt": "MiniMax-H3 is guidance-distilled and has no negative prompt",
    "guidance_scale": "MiniMax-H3 is guidance-distilled",
    "guidance_scale_2": "MiniMax-H3 is guidance-distilled",
    "true_cfg_scale": "MiniMax-H3 is guidance-distilled",
    "boundary_ratio": "a Wan2.2 option",
    "generate_sound": "MiniMax-H3 always generates audio",
    "sound_duration": "the audio always matches the video",
}


@dataclass(frozen=True)
class MediaSource:
    """One media input as the client sent it: an upload, or an http(s)/data URL."""

    field: str  # e.g. "input_references[2]": names the input in errors
    kind: MediaKind | None  # what the field declares
    upload: UploadFile | None = None
    url: str | None = None


@dataclass(frozen=True)
class ParsedFields:
    """Typed values: `values` are GenerationRequest keyword arguments (no media yet)."""

    values: dict[str, Any]
    media: tuple[MediaSource, ...] = ()
    frame_indices: tuple[int, ...] | None = None
    model: str | None = None
    seconds: str | None = None  # the requested duration as sent, for the job's `seconds`
    aliases: dict[str, str] = field(default_factory=dict)  # GenerationRequest field -> field the client sent
    lora: LoraField | None = None  # the `lora` object, resolved against the server's catalog when queued


def _on_grid(pixels: int) -> int:
    """An explicit edge floored to the model's grid, as vLLM-Omni does (the OpenAI SDK's 1280x720 becomes
    1280x704); the job's `size` reports what is generated. Below one grid step the value is left for validation
    to refuse."""
    step = limits.SPATIAL_MULTIPLE
    return pixels - pixels % step if pixels >= step else pixels


def _first(*candidates: tuple[str, Any]) -> tuple[str, Any] | None:
    """The first (param, value) pair whose value was given."""
    return next(((p, v) for p, v in candidates if v is not None), None)


def _extra_params(fields: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    extra = as_object(fields["extra_params"], "extra_params") if "extra_params" in fields else {}
    reject_unknown([f"extra_params.{k}" for k in extra if k not in EXTRA_KEYS],
                   f"extra_params accepts: {', '.join(EXTRA_KEYS)}.")
    target = as_object(extra["target"], "extra_params.target") if "target" in extra else {}
    reject_unknown([f"extra_params.target.{k}" for k in target if k not in TARGET_KEYS],
                   f"extra_params.target accepts: {', '.join(TARGET_KEYS)}.")
    return extra, target


def _check_field_names(body: RequestBody) -> None:
    names = sorted(set(body.fields) | set(body.uploads))
    unsupported = [n for n in names if n in UNSUPPORTED]
    if unsupported:
        reasons = "; ".join(f"{n}: {UNSUPPORTED[n]}" for n in unsupported)
        raise bad_request(f"Unsupported field{'s' if len(unsupported) > 1 else ''}: {reasons}.", unsupported[0],
                          "unsupported_field")
    reject_unknown([n for n in names if n not in SCALAR_FIELDS and n not in MEDIA_FIELDS and n not in MASK_FIELDS])
    uploads_in_text = sorted(set(body.uploads) - set(MEDIA_FIELDS) - set(MASK_FIELDS))
    if uploads_in_text:
        raise bad_request(f"{uploads_in_text[0]}: a file upload is not accepted here", uploads_in_text[0])


def parse_fields(body: RequestBody) -> ParsedFields:
    """Every field read and typed; 400 on an unknown, unsupported, duplicated or ill-typed one."""
    _check_field_names(body)
    _extra_params(body.fields)  # unknown keys are named before any value is checked
    for name in SCALAR_FIELDS:
        if name not in LIST_FIELDS and isinstance(body.fields.get(name), list):  # a form field sent twice
            raise bad_request(f"{name}: given more than once", name)
    f = {**body.fields, **coerce_fields(body.fields)}  # typed and range-checked by the one request model
    extra, target = _extra_params(f)
    values: dict[str, Any] = {}
    aliases: dict[str, str] = {}

    if "prompt" not in f:
        raise bad_request("prompt: is required", "prompt", "missing_field")
    values["prompt"] = as_text(f["prompt"], "prompt")

    duration = _first(
        ("extra_params.target.duration_seconds", target.get("duration_seconds")),
        ("extra_params.duration_seconds", extra.get("duration_seconds")),
        ("extra_params.duration", extra.get("duration")),
        ("seconds", f.get("seconds")),
    )
    seconds_label = None
    if duration is not None:
        param, raw = duration
        values["duration_s"] = as_number(raw, param)
        aliases["duration"] = param
        sent = body.fields.get("seconds") if param == "seconds" else None
        seconds_label = sent.strip() if isinstance(sent, str) else f"{values['duration_s']:g}"

    if "size" in f:
        match = _SIZE.match(as_text(f["size"], "size"))
        if not match:
            raise bad_request(f"size: must look like 1344x768 (WIDTHxHEIGHT), got {preview(f['size'])}", "size")
        values["width"], values["height"] = _on_grid(int(match.group(1))), _on_grid(int(match.group(2)))
        aliases.update(width="size", height="size")
    else:
        for name in ("width", "height"):
            if name in f:
                values[name] = _on_grid(as_int(f[name], name))

    ratio = _first(
        ("extra_params.target.aspect_ratio", target.get("aspect_ratio")),
        ("extra_params.aspect_ratio", extra.get("aspect_ratio")),
        ("aspect_ratio", f.get("aspect_ratio")),
    )
    if ratio is not None:  # a JSON number is a ratio as well (1.7778)
        raw = ratio[1]
        is_number = isinstance(raw, int | float) and not isinstance(raw, bool)
        values["aspect_ratio"] = repr(float(raw)) if is_number else as_text(raw, ratio[0])
        aliases["aspect_ratio"] = ratio[0]
    edge = _first(
        ("extra_params.target.short_edge", target.get("short_edge")),
        ("extra_params.short_edge", extra.get("short_edge")),
        ("short_edge", f.get("short_edge")),
    )
    if edge is not None:
        values["short_edge"] = as_int(edge[1], edge[0])
        aliases["short_edge"] = edge[0]

    if "num_frames" in f:
        values["num_frames"] = as_int(f["num_frames"], "num_frames")
    if "fps" in f and as_number(f["fps"], "fps") != limits.FPS:
        raise bad_request(f"fps: MiniMax-H3 output is fixed at {limits.FPS} fps, got {f['fps']}", "fps")
    if "num_inference_steps" in f:
        values["steps"] = as_int(f["num_inference_steps"], "num_inference_steps")
        aliases["steps"] = "num_inference_steps"
    if "seed" in f:
        values["seed"] = as_int(f["seed"], "seed")
    if "quality" in f:  # DiT cache policy; its values are checked by h3serve.validate
        values["quality"] = as_text(f["quality"], "quality")
    if "num_outputs_per_prompt" in f and as_int(f["num_outputs_per_prompt"], "num_outputs_per_prompt") != 1:
        raise bad_request("num_outputs_per_prompt: one video per request (create several jobs instead)",
                          "num_outputs_per_prompt")
    if "user" in f:
        as_text(f["user"], "user")  # accepted for OpenAI compatibility; not used

    shift = _first(("extra_params.flow_shift", extra.get("flow_shift")), ("flow_shift", f.get("flow_shift")))
    if shift is not None:
        values["flow_shift"] = as_number(shift[1], shift[0])
        aliases["flow_shift"] = shift[0]
    if "audio_flow_shift" in extra:
        values["audio_flow_shift"] = as_number(extra["audio_flow_shift"], "extra_params.audio_flow_shift")
        aliases["audio_flow_shift"] = "extra_params.audio_flow_shift"

    for name in LONG_VIDEO_KEYS:  # extra_params wins over the top level, as for every other option
        found = _first((f"extra_params.{name}", extra.get(name)), (name, f.get(name)))
        if found is not None:
            values[name] = tuple(found[1]) if isinstance(found[1], list) else found[1]
            aliases[name] = found[0]

    for name in MASK_FIELDS:
        if name in body.fields or name in body.uploads:
            values[name] = _mask(body, name)

    if "task" in extra:  # validate checks the value: one of t2va, fl2va, ref2va, agreeing with the media
        values["task"] = as_text(extra["task"], "extra_params.task")
        aliases["task"] = "extra_params.task"

    indices = _first(
        ("extra_params.target.frame_indices", target.get("frame_indices")),
        ("extra_params.frame_indices", extra.get("frame_indices")),
        ("extra_params.frame_index", extra.get("frame_index")),
    )
    return ParsedFields(
        values=values,
        media=_media_sources(body),
        frame_indices=None if indices is None else as_int_list(indices[1], indices[0]),
        model=as_text(f["model"], "model") if "model" in f else None,
        seconds=seconds_label,
        aliases=aliases,
        lora=_lora(f["lora"]) if "lora" in f else None,
    )


def _lora(value: Any) -> LoraField | None:
    """The `lora` object (a JSON value, or JSON text in a form field)."""
    try:
        return None if value is None else parse_lora_field(as_object(value, "lora"))
    except RequestError as e:
        raise bad_request(str(e), e.field) from None


def _mask(body: RequestBody, name: str) -> Any:
    """A mask's JSON value: from an uploaded JSON file, a form field's JSON text, or a JSON body's value."""
    uploads = body.uploads.get(name, [])
    if len(uploads) + (name in body.fields) > 1:
        raise bad_request(f"{name}: given more than once", name)
    try:
        if uploads:  # one byte over the limit is enough for parse_mask_json to refuse the size
            upload = uploads[0]
            upload.file.seek(0)
            return parse_mask_json(upload.file.read(limits.MAX_MASK_BYTES + 1))
        value = body.fields[name]
        if isinstance(value, str):
            return parse_mask_json(value)
        return parse_mask_json(json.dumps(value))  # a JSON body's value: the same size and nesting rules
    except MaskError as e:
        raise bad_request(f"{name}: {e}", name) from None


# -- media fields ---------------------------------------------------------------------------------------------


def _url_items(value: Any, name: str, url_key: str) -> list[str]:
    """URLs from `{"<url_key>": url}`, a list of those, their JSON text, or a bare http(s)/data URL."""
    if isinstance(value, str) and value.strip().startswith(URL_PREFIXES):
        return [value.strip()]
    value = as_json(value, name)
    items = value if isinstance(value, list) else [value]
    urls = []
    for i, item in enumerate(items):
        param = f"{name}[{i}]" if isinstance(value, list) else name
        if isinstance(item, str) and item.strip().startswith(URL_PREFIXES):
            urls.append(item.strip())
            continue
        if not isinstance(item, dict):
            raise bad_request(f"{param}: must be an object like {{\"{url_key}\": \"https://...\"}}", param)
        if "file_id" in item:
            raise bad_request(f"{param}: file_id is not supported; send a file or an http(s)/data URL", param)
        unknown = sorted(set(item) - {url_key})
        if unknown or url_key not in item:
            raise bad_request(f"{param}: expected exactly one key, {url_key!r}; got {sorted(item)}", param)
        urls.append(as_text(item[url_key], f"{param}.{url_key}").strip())
    return urls


def _media_sources(body: RequestBody) -> tuple[MediaSource, ...]:
    sources: list[MediaSource] = []
    for name, (kind, url_key) in MEDIA_FIELDS.items():
        uploads = body.uploads.get(name, [])
        many = name == "input_references" or len(uploads) > 1
        sources += [MediaSource(f"{name}[{i}]" if many else name, kind, upload=u) for i, u in enumerate(uploads)]
        if name in body.fields:
            if url_key is None:
                raise bad_request(f"{name}: must be file uploads (multipart/form-data)", name)
            urls = _url_items(body.fields[name], name, url_key)
            many = many or len(urls) > 1
            sources += [MediaSource(f"{name}[{i}]" if many else name, kind, url=u) for i, u in enumerate(urls)]
    if sum(s.field.split("[")[0] == "input_reference" for s in sources) > 1:
        # One keyframe, as in the OpenAI API: several files go in input_references or the *_reference fields.
        raise bad_request("input_reference: one file only (use input_references for several)", "input_reference")
    _check_combination({s.field.split("[")[0] for s in sources})
    if len(sources) > limits.MAX_MEDIA_FILES:
        raise bad_request(f"at most {limits.MAX_MEDIA_FILES} media inputs per request, got {len(sources)}",
                          sources[limits.MAX_MEDIA_FILES].field, "too_many_files")
    return tuple(sources)


def _check_combination(fields_used: set[str]) -> None:
    """vLLM-Omni's rules: a mixed upload list stands alone; one keyframe upload excludes image/video refs."""
    if "input_references" in fields_used and fields_used & {"input_reference", "image_reference", "video_reference"}:
        raise bad_request(
            "input_references cannot be combined with input_reference, image_reference or video_reference",
            "input_references",
        )
    if "input_reference" in fields_used and fields_used & {"image_reference", "video_reference"}:
        raise bad_request("input_reference cannot be combined with image_reference or video_reference",
                          "input_reference")
