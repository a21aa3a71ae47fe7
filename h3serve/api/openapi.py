"""OpenAPI documentation of the create body (read by hand, so FastAPI cannot infer it) and the error responses."""

from __future__ import annotations

from typing import Any

from h3serve import limits
from h3serve.api.schemas import ErrorBody

_URL_OBJECTS = {"type": "string", "description": 'JSON: {"<kind>_url": "https://... or data:..."} or a list of them'}
_FIELDS: dict[str, dict[str, Any]] = {
    "prompt": {"type": "string", "maxLength": limits.MAX_PROMPT_CHARS},
    "model": {"type": "string", "description": "must match the served model name if given"},
    "seconds": {
        "type": "string",
        "description": f"duration in seconds, {limits.MIN_DURATION_S:g} to {limits.MAX_DURATION_S:g} "
        "(snapped up to a 17n+5 frame count)",
    },
    "size": {
        "type": "string",
        "pattern": r"^\d+x\d+$",
        "description": f"WIDTHxHEIGHT, multiples of {limits.SPATIAL_MULTIPLE}",
    },
    "width": {"type": "integer"},
    "height": {"type": "integer"},
    "num_frames": {"type": "integer", "description": "instead of seconds; snapped up to 17n+5"},
    "fps": {"type": "number", "enum": [limits.FPS]},
    "aspect_ratio": {"type": "string", "description": "W:H, instead of size"},
    "num_inference_steps": {"type": "integer", "minimum": limits.MIN_STEPS, "maximum": limits.MAX_STEPS},
    "flow_shift": {"type": "number"},
    "seed": {"type": "integer"},
    "user": {"type": "string"},
    "num_outputs_per_prompt": {"type": "integer", "enum": [1]},
    "extra_params": {
        "type": "string",
        "description": "JSON object: task (t2va|fl2va|ref2va), duration, duration_seconds, aspect_ratio, "
        "flow_shift, audio_flow_shift, frame_indices, frame_index, target {duration_seconds, aspect_ratio, "
        "frame_indices}",
    },
    "input_reference": {"type": "string", "format": "binary", "description": "keyframe image (or image_url)"},
    "input_references": {"type": "array", "items": {"type": "string", "format": "binary"}},
    "image_reference": _URL_OBJECTS,
    "video_reference": _URL_OBJECTS,
    "audio_reference": _URL_OBJECTS,
}
_JSON_FIELDS = {
    name: ({"type": "object"} if name == "extra_params" else {"type": "string"} if "format" in spec else spec)
    for name, spec in _FIELDS.items()
    if name != "input_references"
}

CREATE_REQUEST_BODY: dict[str, Any] = {
    "required": True,
    "content": {
        "multipart/form-data": {"schema": {"type": "object", "required": ["prompt"], "properties": _FIELDS}},
        "application/x-www-form-urlencoded": {
            "schema": {"type": "object", "required": ["prompt"], "properties": _JSON_FIELDS}
        },
        "application/json": {"schema": {"type": "object", "required": ["prompt"], "properties": _JSON_FIELDS}},
    },
}


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    return {status: {"model": ErrorBody, "description": "error"} for status in statuses}
