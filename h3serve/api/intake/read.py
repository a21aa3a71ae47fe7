"""A create request read into what the server checks and stores: the one request model
(`request_model.VideoCreateFields`) and its media inputs (`MediaSource`s, not yet stored).

The body (multipart, urlencoded or JSON: `body.py`) gives the fields. Top-level fields: prompt, model, seconds, size,
width, height, num_frames, fps, aspect_ratio, short_edge, num_inference_steps, flow_shift, seed, user,
num_outputs_per_prompt, quality, lora, extra_params, the long video and editing options (also accepted in
extra_params, which wins), the masks (JSON values, JSON text or JSON files), and the media fields (`MEDIA_FIELDS`).
`extra_params` keys win over top-level fields (as in vLLM-Omni): task, duration, duration_seconds, aspect_ratio,
short_edge, flow_shift, audio_flow_shift, frame_indices, frame_index, sample_solver (extra_params only) and `target`
{duration_seconds, aspect_ratio, short_edge, frame_indices}. The canvas rule is h3serve/rules/canvas.py. Anything
else is refused with a 400 that names it; so is a field sent twice.

Media inputs are uploads or http(s)/data URLs, combined by vLLM-Omni's rules. `generation_request.py` stores them
and places them as keyframes or references.
"""


from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import UploadFile

from h3serve.adapters.catalog import LoraField
from h3serve.api.error_envelope import bad_request
from h3serve.api.intake.body import RequestBody, read_body
from h3serve.api.intake.field_errors import field_error
from h3serve.api.intake.guide_fields import (
    FILES_FIELD,
    MANIFEST_FIELD,
    GuideFields,
    check_extra_params,
    read_guide_fields,
)
from h3serve.api.intake.json_values import as_json, as_object, as_text, reject_unknown
from h3serve.api.intake.request_model import MASK_FIELDS, SCALAR_FIELDS, ExtraParams, Target, VideoCreateFields
from h3serve.rules import limits
from h3serve.rules.edit_mask import MaskError, parse_mask_json
from h3serve.rules.request import MediaKind
from h3serve.rules.shown import shown

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
    "control_reference": ("video", "video_url"),  # a ControlNet control (h3serve/api/intake/control.py)
    "source_reference": ("video", "video_url"),
    "mask_reference": ("image", "image_url"),  # an image, or a gray video (typed from the bytes)
}
SOURCE_FIELDS = ("source_video", "source_audio")
KEYFRAME_FIELD = "input_reference"  # one image: the first FL2VA keyframe, unless a task says otherwise


VIDEO_FIELD = "video"  # the edit and extend routes' source video: a file or {"id": ...}

EXTRA_KEYS = tuple(ExtraParams.model_fields)
TARGET_KEYS = tuple(Target.model_fields)
LIST_FIELDS = ("continuation_prompts", "start_time_seconds")  # lists: repeated form fields or `name[]` parts
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
# Fields whose explicit JSON null is refused (the schema allows no null), in the order they are checked, with
# what the value must be; the other optional fields read a null as "not given".
_NUMBER, _INTEGER = "must be a finite number, got None", "must be an integer, got None"
_TEXT = "must be a string, got NoneType"
_NOT_NULL: dict[str, str] = {
    "size": _TEXT,
    "width": _INTEGER,
    "height": _INTEGER,
    "num_frames": _INTEGER,
    "fps": _NUMBER,
    "num_inference_steps": _INTEGER,
    "seed": _INTEGER,
    "quality": _TEXT,
    "num_outputs_per_prompt": _INTEGER,
    "n": _INTEGER,
    "user": _TEXT,
}
_EXTRA_NOT_NULL: dict[str, str] = {"audio_flow_shift": _NUMBER, "task": _TEXT}


@dataclass(frozen=True)
class MediaSource:
    """One media input as the client sent it: an upload, or an http(s)/data URL."""

    field: str  # e.g. "input_references[2]": names the input in errors
    kind: MediaKind | None  # what the field declares
    upload: UploadFile | None = None
    url: str | None = None


@dataclass(frozen=True)
class CreateRequest:
    """A create request as read: its typed fields, its media inputs and (routes that take one) its source video."""

    fields: VideoCreateFields
    sources: tuple[MediaSource, ...]
    lora: LoraField | None  # the `lora` object, shape-checked (resolved against the catalog when the job is built)
    video: MediaSource | str | None = None  # an uploaded file, or a completed video's id
    guides: GuideFields = GuideFields()  # timeline guides: the manifest (unchecked) and the guide_files uploads


async def read_create_request(
    request: Request, max_body_bytes: int, take_video: bool = False, guide_files: int = limits.GUIDE_MAX_UNIQUE_FILES
) -> CreateRequest:
    """The body read, every field typed and range-checked and every media input read (400/413/415 naming the field).
    `take_video`: the route's `video` field (edits, extensions) is read apart from the other media. `guide_files`:
    the timeline guide uploads a multipart body may hold beside the other media."""
    body = await read_body(request, max_body_bytes, limits.MAX_MEDIA_FILES + guide_files)
    body, video = _split_video(body) if take_video else (body, None)
    guides = read_guide_fields(body)
    body = RequestBody({k: v for k, v in body.fields.items() if k != MANIFEST_FIELD},
                       {k: v for k, v in body.uploads.items() if k != FILES_FIELD}, body.form)
    fields = await run_in_threadpool(read_request_fields, body)  # JSON text in form fields, long strings
    sources = await run_in_threadpool(media_sources, body)
    return CreateRequest(fields, sources, fields.lora_field(), video, guides)


def read_request_fields(body: RequestBody) -> VideoCreateFields:
    """Every non-file field read, typed and range-checked; 400 on an unknown, unsupported, duplicated or ill-typed
    one (the media fields are read by `media_fields.media_sources`)."""
    _check_field_names(body)
    _extra_params(body.fields)  # unknown keys are named before any value is checked
    for name in SCALAR_FIELDS:
        if name not in LIST_FIELDS and isinstance(body.fields.get(name), list):  # a form field sent twice
            raise bad_request(f"{name}: given more than once", name)
    try:
        fields = VideoCreateFields.model_validate({k: v for k, v in body.fields.items() if k in SCALAR_FIELDS})
    except ValidationError as e:
        raise field_error(e) from None
    _refuse_nulls(fields)
    masks = {name: _mask(body, name) for name in MASK_FIELDS if name in body.fields or name in body.uploads}
    return fields.model_copy(update=masks)


def _check_field_names(body: RequestBody) -> None:
    names = sorted(set(body.fields) | set(body.uploads))
    unsupported = [n for n in names if n in UNSUPPORTED]
    if unsupported:
        reasons = "; ".join(f"{n}: {UNSUPPORTED[n]}" for n in unsupported)
        raise bad_request(
            f"Unsupported field{'s' if len(unsupported) > 1 else ''}: {reasons}.", unsupported[0], "unsupported_field"
        )
    reject_unknown([n for n in names if n not in SCALAR_FIELDS and n not in MEDIA_FIELDS and n not in MASK_FIELDS])
    uploads_in_text = sorted(set(body.uploads) - set(MEDIA_FIELDS) - set(MASK_FIELDS))
    if uploads_in_text:
        raise bad_request(f"{uploads_in_text[0]}: a file upload is not accepted here", uploads_in_text[0])


def _extra_params(fields: dict[str, Any]) -> None:
    """400 naming every unknown key of extra_params and of its target (or an extra_params that is no object)."""
    extra = as_object(fields["extra_params"], "extra_params") if "extra_params" in fields else {}
    check_extra_params(extra)
    reject_unknown(
        [f"extra_params.{k}" for k in extra if k not in EXTRA_KEYS], f"extra_params accepts: {', '.join(EXTRA_KEYS)}."
    )
    target = as_object(extra["target"], "extra_params.target") if "target" in extra else {}
    reject_unknown(
        [f"extra_params.target.{k}" for k in target if k not in TARGET_KEYS],
        f"extra_params.target accepts: {', '.join(TARGET_KEYS)}.",
    )


def _refuse_nulls(fields: VideoCreateFields) -> None:
    """400 for an explicit null where a value must be given (`"seed": null`); a size beside it wins for edges."""
    given = fields.model_fields_set
    for name, must in _NOT_NULL.items():
        if name in given and getattr(fields, name) is None and not (name in ("width", "height") and "size" in given):
            raise bad_request(f"{name}: {must}", name)
    extra = fields.extra_params
    for name, must in _EXTRA_NOT_NULL.items():
        if extra is not None and name in extra.model_fields_set and getattr(extra, name) is None:
            raise bad_request(f"extra_params.{name}: {must}", f"extra_params.{name}")
    if "model" in given and fields.model is None:
        raise bad_request(f"model: {_TEXT}", "model")


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
            raise bad_request(f'{param}: must be an object like {{"{url_key}": "https://..."}}', param)
        if "file_id" in item:
            raise bad_request(f"{param}: file_id is not supported; send a file or an http(s)/data URL", param)
        unknown = sorted(set(item) - {url_key})
        if unknown or url_key not in item:
            raise bad_request(f"{param}: expected exactly one key, {url_key!r}; got {shown(sorted(item))}", param)
        urls.append(as_text(item[url_key], f"{param}.{url_key}").strip())
    return urls


def media_sources(body: RequestBody) -> tuple[MediaSource, ...]:
    """Every media input of the body, in field order; 400 naming the field on a malformed one or a forbidden mix."""
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
        raise bad_request(
            f"at most {limits.MAX_MEDIA_FILES} media inputs per request, got {len(sources)}",
            sources[limits.MAX_MEDIA_FILES].field,
            "too_many_files",
        )
    return tuple(sources)


def _check_combination(fields_used: set[str]) -> None:
    """vLLM-Omni's rules: a mixed upload list stands alone; one keyframe upload excludes image/video refs."""
    if "input_references" in fields_used and fields_used & {"input_reference", "image_reference", "video_reference"}:
        raise bad_request(
            "input_references cannot be combined with input_reference, image_reference or video_reference",
            "input_references",
        )
    if "input_reference" in fields_used and fields_used & {"image_reference", "video_reference"}:
        raise bad_request(
            "input_reference cannot be combined with image_reference or video_reference", "input_reference"
        )


def _split_video(body: RequestBody) -> tuple[RequestBody, MediaSource | str | None]:
    """The `video` field (a file, or `{"id": ...}` / its JSON text) and the rest of the body."""
    fields, uploads = dict(body.fields), dict(body.uploads)
    files = uploads.pop(VIDEO_FIELD, [])
    value = fields.pop(VIDEO_FIELD, None)
    if len(files) + (value is not None) > 1:
        raise bad_request("video: give one file or one {\"id\": ...}", VIDEO_FIELD)
    rest = RequestBody(fields, uploads, body.form)
    if files:
        return rest, MediaSource(VIDEO_FIELD, "video", upload=files[0])
    if value is None:
        return rest, None
    value = as_json(value, VIDEO_FIELD) if isinstance(value, str) and value.strip().startswith("{") else value
    if isinstance(value, dict) and set(value) == {"id"} and isinstance(value["id"], str):
        return rest, value["id"]
    raise bad_request('video: must be a video file or {"id": "<a completed video id>"}', VIDEO_FIELD)
