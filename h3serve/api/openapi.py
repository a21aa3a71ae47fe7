"""OpenAPI documentation of the create body, generated from `request_model.VideoCreateFields` (the model that
also checks the fields, so the two cannot drift), plus the media fields and the error responses."""

from __future__ import annotations

import copy
from collections.abc import Iterable
from typing import Any

from fastapi.routing import APIRoute, iter_route_contexts
from starlette.routing import BaseRoute

from h3serve.api.intake.read import URL_PREFIXES
from h3serve.api.intake.request_model import CROSS_FIELD_RULES, VideoCreateFields
from h3serve.api.schemas import ErrorBody
from h3serve.rules import limits

_URL_PATTERN = "^\\s*(" + "|".join(URL_PREFIXES) + ")"  # the prefixes media_fields reads as URLs
_URL = {"type": "string", "pattern": _URL_PATTERN, "description": "an http(s) URL or a data: URL"}


def _url_objects(key: str) -> dict[str, Any]:
    item = {"type": "object", "properties": {key: _URL}, "required": [key], "additionalProperties": False}
    return {"anyOf": [_URL, item, {"type": "array", "items": {"anyOf": [_URL, item]}, "minItems": 1, "maxItems": 3}]}


_MEDIA_URLS: dict[str, Any] = {
    "input_reference": _url_objects("image_url"),
    "image_reference": _url_objects("image_url"),
    "video_reference": _url_objects("video_url"),
    "audio_reference": _url_objects("audio_url"),
    "control_reference": _url_objects("video_url"),  # a ControlNet control (with extra_params.<type>)
    "source_reference": _url_objects("video_url"),
    "mask_reference": _url_objects("image_url"),
}
_BINARY = {"type": "string", "format": "binary"}


def _inlined(schema: dict[str, Any]) -> dict[str, Any]:
    """The model's JSON schema with every `$ref` replaced by its definition (the body lives outside components)."""
    defs = schema.pop("$defs", {})

    def walk(node: Any) -> Any:
        if isinstance(node, dict):
            if "$ref" in node:
                return walk(copy.deepcopy(defs[node["$ref"].split("/")[-1]]))
            return {k: walk(v) for k, v in node.items()}
        if isinstance(node, list):
            return [walk(v) for v in node]
        return node

    inlined: dict[str, Any] = walk(schema)
    return inlined


def _strip_nulls(node: Any) -> Any:
    """`X | None = None` means 'optional', not 'may be null': drop the null member so clients see the type."""
    if isinstance(node, dict):
        options = node.get("anyOf")
        if options is not None and {"type": "null"} in options:
            rest = [o for o in options if o != {"type": "null"}]
            merged = {k: v for k, v in node.items() if k not in ("anyOf", "default")}
            node = {**merged, **rest[0]} if len(rest) == 1 else {**merged, "anyOf": rest}
        node.pop("default", None)
        node.pop("title", None)
        return {k: _strip_nulls(v) for k, v in node.items()}
    if isinstance(node, list):
        return [_strip_nulls(v) for v in node]
    return node


def _request_body(
    json_body: dict[str, Any], form: dict[str, Any], multipart: dict[str, Any] | None = None
) -> dict[str, Any]:
    """An OpenAPI requestBody taking the same fields as JSON, urlencoded form and (with uploads) multipart."""
    content = {"application/json": {"schema": json_body}}
    if multipart is not None:
        content["multipart/form-data"] = {"schema": multipart}
    content["application/x-www-form-urlencoded"] = {"schema": form}
    return {"required": True, "content": content}


_FORM_OBJECTS = "extra_params and lora: JSON text or bracketed fields (extra_params[task]=ref2va, lora[name]=turbo)."


def _form_fields(fields: dict[str, Any]) -> dict[str, Any]:
    """A form body's fields: the JSON body's, less its object fields (a form states them as JSON text or bracketed
    keys, which a schema for form fields cannot describe)."""
    form = copy.deepcopy(fields)
    for name in ("extra_params", "lora"):
        form["properties"].pop(name, None)
    form["description"] = f"{form.get('description', '')} {_FORM_OBJECTS}".strip()
    return form


def create_body_schema(served_model_name: str | None = None) -> dict[str, Any]:
    """The requestBody of POST /v1/videos(/sync) for JSON, urlencoded and multipart bodies."""
    fields = _strip_nulls(_inlined(VideoCreateFields.model_json_schema()))
    if served_model_name is not None:
        fields["properties"]["model"]["enum"] = [served_model_name]
    rules = "; ".join(CROSS_FIELD_RULES.values())
    json_body = copy.deepcopy(fields)
    json_body["properties"].update(_MEDIA_URLS)
    json_body["description"] = f"Rules no schema can state (each a 400 naming the field): {rules}."
    # Form bodies carry strings; the object fields go as JSON text or bracketed keys (extra_params[task]=ref2va).
    form = _form_fields(fields)
    form["properties"].update({k: {"type": "string", "pattern": _URL_PATTERN} for k in _MEDIA_URLS})
    form["description"] = json_body["description"] + f" {_FORM_OBJECTS}"
    multipart = copy.deepcopy(form)
    multipart["properties"].update(
        input_reference=_BINARY,
        input_references={"type": "array", "items": _BINARY, "maxItems": limits.MAX_MEDIA_FILES},
        control_reference=_BINARY,
        source_reference=_BINARY,
        mask_reference=_BINARY,
    )
    return _request_body(json_body, form, multipart)


CREATE_REQUEST_BODY = create_body_schema()

_VIDEO_ID = {"type": "object", "properties": {"id": {"type": "string"}}, "required": ["id"],
             "additionalProperties": False, "description": "a completed video job of this server"}
_MASK = {
    "anyOf": [{"type": "number", "minimum": 0, "maximum": 1}, {"type": "array"}],
    "description": "values in [0, 1] on the latent grid (1 = generate, 0 = keep): docs/long_video_and_editing.md",
}


def derived_body_schema(video: bool, required: tuple[str, ...] = ("prompt",)) -> dict[str, Any]:
    """The requestBody of the routes that make a job from a video: remix (the path names the video) and, with
    `video`, edits and extensions (`video` is an upload or {"id": ...} of a completed job; masks for edits)."""
    fields = _strip_nulls(_inlined(VideoCreateFields.model_json_schema()))
    fields["required"] = list(required)
    json_body = copy.deepcopy(fields)
    form = _form_fields(fields)
    if not video:
        return _request_body(json_body, form)
    # Masks are documented on the JSON body; forms may carry them as JSON text or uploads (the same rules apply).
    json_body["properties"].update(video=_VIDEO_ID, video_noise_mask=_MASK, audio_noise_mask=_MASK)
    form["properties"]["video"] = {
        "type": "string",
        "pattern": r'^[ \t\n\r]*\{[ \t\n\r]*"id"[ \t\n\r]*:[ \t\n\r]*"[A-Za-z0-9_]*"[ \t\n\r]*\}[ \t\n\r]*$',
        "description": '{"id": "<a completed video id>"} as JSON text',
    }
    multipart = copy.deepcopy(form)
    multipart["properties"]["video"] = {"anyOf": [_BINARY, form["properties"]["video"]]}
    for schema in (json_body, form, multipart):
        schema["required"] = [*required, "video"]
    return _request_body(json_body, form, multipart)


def _link(operation_id: str) -> dict[str, Any]:
    return {"operationId": operation_id, "parameters": {"video_id": "$response.body#/id"}}


# The created job's id feeds the routes that take it (OpenAPI links: clients and stateful fuzzers follow them).
CREATED_LINKS: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "the created job",
        "links": {
            "RetrieveVideo": _link("retrieve_video_v1_videos__video_id__get"),
            "DownloadVideo": _link("download_video_v1_videos__video_id__content_get"),
            "DeleteVideo": _link("delete_video_v1_videos__video_id__delete"),
        },
    }
}


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    return {status: {"model": ErrorBody, "description": "error"} for status in statuses}


def exact_request_bodies(document: dict[str, Any], routes: Iterable[BaseRoute]) -> dict[str, Any]:
    """`document` with each route's own requestBody (its `openapi_extra`) put back as written.

    FastAPI validates the document through pydantic models whose bounds are floats, so a body that two routes
    share came out with `"maximum": 9.223372036854775e+18` (2**63, which the server refuses) where the schema says
    the integer 9223372036854775807; the bodies here are plain JSON already and go out unchanged."""
    for context in iter_route_contexts(list(routes)):  # routes with their routers' prefixes
        route = context.original_route
        body = (route.openapi_extra or {}).get("requestBody") if isinstance(route, APIRoute) else None
        if body is None:
            continue
        for method in context.methods or ():
            operation = document.get("paths", {}).get(context.path_format, {}).get(method.lower())
            if operation is not None:
                operation["requestBody"] = copy.deepcopy(body)
    return document
