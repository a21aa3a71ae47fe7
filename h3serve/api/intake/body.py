"""Read a create request's body (multipart, urlencoded or JSON) into nested fields plus uploaded files.

Decoding a whole body (JSON, percent-encoding) is CPU work proportional to its size: it runs in a worker
thread, so a 60 MB body never stalls the event loop (and /health). Multipart is parsed as it streams, a chunk
at a time, and must end with its closing boundary.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from starlette.datastructures import FormData, UploadFile
from starlette.formparsers import MultiPartException, MultiPartParser

from h3serve.api.error_envelope import APIError, bad_request
from h3serve.api.intake.form_keys import BracketError, base_name, unflatten
from h3serve.api.intake.json_values import parse_json
from h3serve.api.percent import form_pairs
from h3serve.rules import limits
from h3serve.rules.shown import shown

MULTIPART = "multipart/form-data"
URLENCODED = "application/x-www-form-urlencoded"
FORM_TYPES = (MULTIPART, URLENCODED)
JSON_TYPE = "application/json"
MAX_FORM_FIELDS = 1000


@dataclass
class RequestBody:
    """Text fields, nested (bracketed keys rebuilt; JSON keeps its types), and uploads by base field name."""

    fields: dict[str, Any]
    uploads: dict[str, list[UploadFile]] = field(default_factory=dict)


class _ClosedMultiPartParser(MultiPartParser):
    """Starlette's parser, noting whether the closing boundary arrived (it accepts a body cut off without one,
    keeping whatever parts were complete: a truncated upload would silently lose its last fields)."""

    closed = False

    def on_end(self) -> None:
        super().on_end()
        self.closed = True


async def read_body(request: Request, max_part_bytes: int) -> RequestBody:
    mime = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if mime == JSON_TYPE:
        return RequestBody(await asyncio.to_thread(_json_object, await request.body()))
    if mime == URLENCODED:
        return _form_body(await asyncio.to_thread(_urlencoded_pairs, await request.body()), {})
    if mime != MULTIPART:
        raise APIError(
            415,
            f"Unsupported Content-Type {shown(mime) if mime else '(none)'}: send {', '.join(FORM_TYPES)} or "
            f"{JSON_TYPE}.",
            "unsupported_media_type",
        )
    form = await _multipart(request, max_part_bytes)
    pairs: list[tuple[str, Any]] = []
    uploads: dict[str, list[UploadFile]] = defaultdict(list)
    for key, value in form.multi_items():
        if isinstance(value, UploadFile):
            if not value.filename and not value.size:  # an empty file input of an HTML form
                continue
            uploads[base_name(key)].append(value)  # `input_references[]` and `input_references` alike
        else:
            pairs.append((key, value))
    return _form_body(pairs, dict(uploads))


async def _multipart(request: Request, max_part_bytes: int) -> FormData:
    parser = _ClosedMultiPartParser(
        request.headers,
        request.stream(),
        max_files=limits.MAX_MEDIA_FILES,
        max_fields=MAX_FORM_FIELDS,
        max_part_size=max_part_bytes,
    )
    try:
        form = await parser.parse()
    except MultiPartException as e:
        if _files_exceeded(e):  # the same rule and code as media sent any other way
            raise bad_request(
                f"at most {limits.MAX_MEDIA_FILES} media inputs per request (every media field together)",
                code="too_many_files",
            ) from None
        raise bad_request(f"Invalid form body: {e.message}", code="invalid_body") from None
    request._form = form  # Request.close() (called by every create) closes the spooled upload files
    if not parser.closed:
        raise bad_request(
            "Invalid form body: the multipart body ends without its closing boundary (truncated?)", code="invalid_body"
        )
    return form


def _form_body(pairs: list[tuple[str, Any]], uploads: dict[str, list[UploadFile]]) -> RequestBody:
    try:
        return RequestBody(unflatten(pairs), uploads)
    except BracketError as e:
        raise bad_request(str(e), param=base_name(e.key), code="invalid_body") from None


def _urlencoded_pairs(raw: bytes) -> list[tuple[str, str]]:
    try:
        return form_pairs(raw, MAX_FORM_FIELDS)
    except ValueError as e:
        raise bad_request(f"Invalid form body: {e}", code="invalid_body") from None


def _json_object(raw: bytes) -> dict[str, Any]:
    try:
        value = parse_json(raw)
    except ValueError as e:
        raise bad_request(f"The body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(value, dict):
        raise bad_request(f"The JSON body must be an object, got {type(value).__name__}.", code="invalid_json")
    return value


def _files_exceeded(e: MultiPartException) -> bool:
    """Starlette's parser says so only in its message ("Too many files. Maximum number of files is N.")."""
    return e.message.startswith("Too many files")
