"""Store a request's media (uploads and URL downloads) as files in the job's input folder.

The files live under the data dir, so a job that is re-run after a restart still finds them. The intake's
per-file byte limits (`h3serve.rules.limits.MAX_*_BYTES`) apply by the file's kind: read from its bytes when they
are recognisable, else what the field declares; a file of unknown kind gets the largest limit and is left
to the media intake to reject.
"""

from __future__ import annotations

import asyncio
import re
import shutil
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from starlette.datastructures import UploadFile

from h3serve.api.error_envelope import APIError
from h3serve.api.media_fields import SOURCE_FIELDS, MediaSource
from h3serve.api.url_fetch import MediaFetcher, MediaFetchError
from h3serve.media.intake import MAX_BYTES
from h3serve.media.raw import atomic_output
from h3serve.media.sniff import HEAD_BYTES, identify, read_head
from h3serve.rules import limits
from h3serve.rules.request import MediaKind, MediaRef

BYTE_LIMITS: dict[MediaKind, int] = MAX_BYTES  # the intake's own per-kind limits, applied before it runs
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")
_MAX_NAME = 80


@dataclass(frozen=True)
class StoredMedia:
    source: MediaSource
    ref: MediaRef
    kind: MediaKind | None  # from the bytes when recognisable, else as declared


def _limit(kind: MediaKind | None, field: str = "") -> int:
    if field in SOURCE_FIELDS:
        return limits.MAX_SOURCE_BYTES  # latent-mask editing sources
    return BYTE_LIMITS[kind] if kind else max(BYTE_LIMITS.values())


def _declared_kind(content_type: str | None) -> MediaKind | None:
    major = (content_type or "").split("/")[0].strip().lower()
    return major if major in BYTE_LIMITS else None  # type: ignore[return-value]


def _file_name(index: int, client_name: str) -> str:
    """`03-clip.mp4`: the position keeps names unique; the client's name is reduced to safe characters."""
    stem = _UNSAFE.sub("_", Path(client_name).name).lstrip(".")[:_MAX_NAME] or "media"
    return f"{index:02d}-{stem}"


def _too_large(source: MediaSource, kind: MediaKind | None, size: int) -> APIError:
    what = "edit sources" if source.field in SOURCE_FIELDS else f"{kind} files" if kind else "media files"
    return APIError(
        413,
        f"{source.field}: {size / 2**20:.1f} MiB is over the {_limit(kind, source.field) // 2**20} MiB limit for "
        f"{what}.",
        "file_too_large",
        source.field,
    )


def _copy(src: BinaryIO, dest: Path) -> None:
    src.seek(0)
    with atomic_output(dest) as tmp, open(tmp, "wb") as f:
        shutil.copyfileobj(src, f, 1 << 20)


async def _store_upload(index: int, source: MediaSource, upload: UploadFile, folder: Path) -> StoredMedia:
    declared = source.kind or _declared_kind(upload.content_type)
    await upload.seek(0)
    fmt = identify(await upload.read(HEAD_BYTES))
    kind = fmt.kind if fmt else declared
    size = upload.size or 0
    if size > _limit(kind, source.field):
        raise _too_large(source, kind, size)
    name = upload.filename or "upload"
    dest = folder / _file_name(index, name)
    await asyncio.to_thread(_copy, upload.file, dest)
    return StoredMedia(source, MediaRef(path=dest, name=name, kind=declared), kind)


def _url_file_name(url: str) -> str:
    """The last path segment of an http(s) URL ("" for a data URL or one too malformed to split)."""
    if url.startswith("data:"):
        return "data"
    try:
        return urllib.parse.urlsplit(url).path.rsplit("/", 1)[-1]
    except ValueError:  # e.g. "http://[::1": the fetcher reports what is wrong with it
        return ""


async def _store_url(
    index: int, source: MediaSource, url: str, folder: Path, fetcher: MediaFetcher, deadline: float
) -> StoredMedia:
    name = url[: url.find(",")] + ",..." if url.startswith("data:") else url
    dest = folder / _file_name(index, _url_file_name(url))
    try:
        media_type = await fetcher.fetch(url, dest, _limit(source.kind, source.field), deadline)
    except MediaFetchError as e:
        status, code = (413, "file_too_large") if e.too_large else (400, "invalid_media_url")
        raise APIError(status, f"{source.field}: {e}", code, source.field) from None
    fmt = identify(await asyncio.to_thread(read_head, dest))
    kind = fmt.kind if fmt else source.kind or _declared_kind(media_type)
    size = (await asyncio.to_thread(dest.stat)).st_size
    if size > _limit(kind, source.field):
        raise _too_large(source, kind, size)
    return StoredMedia(source, MediaRef(path=dest, name=name, kind=source.kind), kind)


async def store_media(sources: tuple[MediaSource, ...], folder: Path, fetcher: MediaFetcher) -> list[StoredMedia]:
    """Every source saved into `folder`, in order. Raises `APIError` (400/413) naming the failing input.

    The URLs of one request share one deadline (`fetcher.timeout_s`), so a request of many slow URLs cannot
    hold its uploads and a queue slot for many times the fetch timeout."""
    stored = []
    deadline = fetcher.deadline()
    for index, source in enumerate(sources):
        if source.upload is not None:
            stored.append(await _store_upload(index, source, source.upload, folder))
        else:
            assert source.url is not None
            stored.append(await _store_url(index, source, source.url, folder, fetcher, deadline))
    return stored
