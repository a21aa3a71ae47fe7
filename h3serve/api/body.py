"""Read a create request's body (multipart, urlencoded or JSON) into nested fields plus uploaded files."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from starlette.datastructures import UploadFile
from starlette.formparsers import MultiPartException

from h3serve import limits
from h3serve.api.brackets import BracketError, base_name, unflatten
from h3serve.api.coerce import parse_json
from h3serve.api.errors import APIError, bad_request

FORM_TYPES = ("multipart/form-data", "application/x-www-form-urlencoded")
JSON_TYPE = "application/json"
MAX_FORM_FIELDS = 1000


@dataclass
class RequestBody:
    """Text fields, nested (bracketed keys rebuilt; JSON keeps its types), and uploads by base field name."""

    fields: dict[str, Any]
    uploads: dict[str, list[UploadFile]] = field(default_factory=dict)


async def read_body(request: Request, max_part_bytes: int) -> RequestBody:
    mime = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if mime == JSON_TYPE:
        return RequestBody(_json_object(await request.body()))
    if mime not in FORM_TYPES:
        raise APIError(
            415,
            f"Unsupported Content-Type {mime or '(none)'!r}: send {', '.join(FORM_TYPES)} or {JSON_TYPE}.",
            "unsupported_media_type",
        )
    try:
        form = await request.form(
            max_files=limits.MAX_MEDIA_FILES, max_fields=MAX_FORM_FIELDS, max_part_size=max_part_bytes
        )
    except MultiPartException as e:
        raise bad_request(f"Invalid form body: {e.message}", code="invalid_body") from None
    pairs: list[tuple[str, Any]] = []
    uploads: dict[str, list[UploadFile]] = defaultdict(list)
    for key, value in form.multi_items():
        if isinstance(value, UploadFile):
            if not value.filename and not value.size:  # an empty file input of an HTML form
                continue
            uploads[base_name(key)].append(value)  # `input_references[]` and `input_references` alike
        else:
            pairs.append((key, value))
    try:
        return RequestBody(unflatten(pairs), dict(uploads))
    except BracketError as e:
        raise bad_request(str(e), param=base_name(e.key), code="invalid_body") from None


def _json_object(raw: bytes) -> dict[str, Any]:
    try:
        value = parse_json(raw)
    except ValueError as e:
        raise bad_request(f"The body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(value, dict):
        raise bad_request(f"The JSON body must be an object, got {type(value).__name__}.", code="invalid_json")
    return value
