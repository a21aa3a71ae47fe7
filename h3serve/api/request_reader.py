"""A create request's body read into the one request model (`request_model.VideoCreateFields`).

Top-level fields: prompt, model, seconds, size, width, height, num_frames, fps, aspect_ratio, short_edge,
num_inference_steps, flow_shift, seed, user, num_outputs_per_prompt, quality, lora, extra_params, the long video
and editing options (also accepted in extra_params, which wins), the masks (JSON values, JSON text or JSON files),
and the media fields (media_fields). `extra_params` keys win over top-level fields (as in vLLM-Omni): task,
duration, duration_seconds, aspect_ratio, short_edge, flow_shift, audio_flow_shift, frame_indices, frame_index,
sample_solver (extra_params only) and `target` {duration_seconds, aspect_ratio, short_edge, frame_indices}. The
canvas rule is h3serve/rules/canvas.py. Anything else is refused with a 400 that names it; so is a field sent twice.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import ValidationError

from h3serve.api.body import RequestBody
from h3serve.api.coerce import as_object, reject_unknown
from h3serve.api.error_envelope import bad_request
from h3serve.api.field_errors import field_error
from h3serve.api.media_fields import MEDIA_FIELDS
from h3serve.api.request_model import MASK_FIELDS, SCALAR_FIELDS, ExtraParams, Target, VideoCreateFields
from h3serve.rules import limits
from h3serve.rules.edit_mask import MaskError, parse_mask_json

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
    "user": _TEXT,
}
_EXTRA_NOT_NULL: dict[str, str] = {"audio_flow_shift": _NUMBER, "task": _TEXT}


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
