"""Timeline guides over HTTP (vLLM-Omni's request; the rules are h3serve/rules/guides.py).

Two top-level fields, never in `extra_params`:
- `timeline_guides`: the manifest, a JSON list of `{"frame_index": int, "image" | "video" | "audio": source}`
  (multipart and urlencoded bodies carry it as JSON text, a JSON body as a list);
- `guide_files`: the files, repeated multipart uploads, numbered from 0 in the order they arrive.

A source is `{"upload_index": N}` (the N-th `guide_files` upload) or `{"url": "https://..." | "data:..."}` (fetched
like any media URL, so JSON bodies can carry guides too). An empty or omitted manifest with no files is a request
without guides. The files are stored with the job's other inputs; a file used by several entries is stored once.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from starlette.datastructures import UploadFile

from h3serve.api.error_envelope import APIError, bad_request, from_request_error
from h3serve.api.intake.body import RequestBody
from h3serve.api.intake.json_values import as_json
from h3serve.errors import RequestError
from h3serve.rules.guides import FIELD, ManifestEntry, check_uploads, entry_field, parse_manifest
from h3serve.rules.request import MediaKind, MediaRef, TimelineGuide

MANIFEST_FIELD = FIELD  # "timeline_guides"
FILES_FIELD = "guide_files"
INTEGER_KEYS = ("frame_index", "upload_index")
_INTEGER = re.compile(r"[-+]?\d{1,18}")
RESERVED_EXTRA_KEYS = {  # what extra_params may not carry, with why
    MANIFEST_FIELD: "is a top-level field (beside repeated guide_files uploads), not an extra_params key",
    "_minimax_h3_timeline_guides": "is reserved for the server (it holds the stored guide files' paths)",
}


@dataclass(frozen=True)
class GuideFields:
    """A create request's guides as read: the manifest's value (not yet checked) and the uploads."""

    manifest: Any = None  # None: not given
    uploads: tuple[UploadFile, ...] = ()

    @property
    def given(self) -> bool:
        return self.manifest is not None or bool(self.uploads)


def read_guide_fields(body: RequestBody) -> GuideFields:
    """The manifest and the uploads out of the body (400 naming the field on a manifest given twice, a manifest sent
    as a file, or a `guide_files` text field)."""
    value = body.fields.get(MANIFEST_FIELD)
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        raise bad_request(f"{MANIFEST_FIELD}: given more than once (send one JSON list)", MANIFEST_FIELD)
    if MANIFEST_FIELD in body.uploads:
        raise bad_request(f"{MANIFEST_FIELD}: the manifest is JSON text, not a file", MANIFEST_FIELD)
    if FILES_FIELD in body.fields:
        raise bad_request(f"{FILES_FIELD}: must be file uploads (multipart/form-data); a JSON body gives each source "
                          'a {"url": ...}', FILES_FIELD)
    if isinstance(value, str):
        value = as_json(value, MANIFEST_FIELD)
    elif body.form and value is not None:
        value = _form_integers(value)
    return GuideFields(value, tuple(body.uploads.get(FILES_FIELD, [])))


def _form_integers(value: Any) -> Any:
    """A manifest sent as bracketed form fields (the OpenAI SDK's `extra_body` in a multipart body:
    `timeline_guides[0][frame_index]=36`): its leaves are text, so the integer fields are read as integers there
    (the JSON manifest keeps vLLM-Omni's strict types)."""
    if isinstance(value, list):
        return [_form_integers(item) for item in value]
    if not isinstance(value, dict):
        return value
    out = {}
    for key, item in value.items():
        if key in INTEGER_KEYS and isinstance(item, str) and _INTEGER.fullmatch(item.strip()):
            out[key] = int(item)
        else:
            out[key] = _form_integers(item)
    return out


def manifest_entries(
    fields: GuideFields, max_entries: int, max_files: int, refusal: str | None = None
) -> tuple[ManifestEntry, ...]:
    """The manifest checked for shape (400 naming the entry and the rule); files without a manifest are refused, and
    so are guides on a server that serves none (`refusal`: why), before any file is stored."""
    if refusal is not None and fields.given and fields.manifest != []:
        raise bad_request(f"{MANIFEST_FIELD}: this server serves no timeline guides: {refusal}", MANIFEST_FIELD)
    if fields.manifest is None:
        if fields.uploads:
            raise bad_request(f"{FILES_FIELD}: uploads need a {MANIFEST_FIELD} manifest that places them",
                              FILES_FIELD)
        return ()
    if len(fields.uploads) > max_files:
        raise bad_request(f"{FILES_FIELD}: {len(fields.uploads)} uploads; this server takes at most {max_files}",
                          f"{FILES_FIELD}[{max_files}]", "too_many_files")
    try:
        return parse_manifest(fields.manifest, max_entries)
    except RequestError as e:
        raise from_request_error(e) from None


def guide_sources(entries: tuple[ManifestEntry, ...], uploads: tuple[UploadFile, ...]) -> list[tuple[str, Any]]:
    """What to store, in order: each upload once (`guide_files[i]`), then each URL source
    (`timeline_guides[i].kind`); (field, upload or URL) pairs."""
    sources: list[tuple[str, Any]] = [(f"{FILES_FIELD}[{i}]", upload) for i, upload in enumerate(uploads)]
    for i, entry in enumerate(entries):
        sources += [(entry_field(i, s.kind), s.url) for s in entry.sources if s.url is not None]
    return sources


def placed_guides(
    entries: tuple[ManifestEntry, ...], stored: dict[str, MediaRef], upload_kinds: list[MediaKind | None]
) -> tuple[TimelineGuide, ...]:
    """The request's guides, each source the stored file of its upload or URL (`stored`: by field), declared as the
    entry's kind (the intake then checks the bytes agree). `upload_kinds`: each upload's kind read from its bytes.
    400 naming the entry on an upload out of range, unused, of another kind, or used as two kinds."""
    try:
        check_uploads(entries, upload_kinds)
    except RequestError as e:
        raise from_request_error(e) from None
    guides = []
    for i, entry in enumerate(entries):
        visual = audio = None
        for source in entry.sources:
            field = entry_field(i, source.kind) if source.url is not None else f"{FILES_FIELD}[{source.upload_index}]"
            ref = stored[field]
            placed = MediaRef(path=Path(ref.path), name=ref.name, kind=source.kind)
            if source.kind == "audio":
                audio = placed
            else:
                visual = placed
        guides.append(TimelineGuide(entry.frame_index, visual, audio))
    return tuple(guides)


def check_extra_params(extra: dict[str, Any]) -> None:
    """400 on a guide manifest (or the server's reserved key) inside extra_params."""
    for key, why in RESERVED_EXTRA_KEYS.items():
        if key in extra:
            raise APIError(400, f"extra_params.{key}: {why}", "invalid_value", f"extra_params.{key}")

