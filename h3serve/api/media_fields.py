"""The create request's media fields (uploads, http(s)/data URLs) read into `MediaSource`s, with vLLM-Omni's
rules for combining them. The files are stored by `media_inputs`, and placed as keyframes or references by
`media_routing`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from starlette.datastructures import UploadFile

from h3serve.api.body import RequestBody
from h3serve.api.coerce import as_json, as_text
from h3serve.api.error_envelope import bad_request
from h3serve.rules import limits
from h3serve.rules.request import MediaKind

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


@dataclass(frozen=True)
class MediaSource:
    """One media input as the client sent it: an upload, or an http(s)/data URL."""

    field: str  # e.g. "input_references[2]": names the input in errors
    kind: MediaKind | None  # what the field declares
    upload: UploadFile | None = None
    url: str | None = None


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
            raise bad_request(f"{param}: expected exactly one key, {url_key!r}; got {sorted(item)}", param)
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
