"""The output store's one interface: where a finished job's files (each output's MP4, thumbnail and spritesheet)
live once published, what it answers about them, and its errors.

Two stores implement it: the data dir on this machine (`LocalFolderStore`, the default) and an S3-compatible
bucket (`S3BucketStore`). Outputs are always written into the job's folder in the data dir first (staged); a
remote store then uploads them, and the job is recorded completed only once a HEAD of every object matches.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Protocol

from h3serve.errors import ClientError, ServerError

CHUNK_BYTES = 256 * 1024  # one piece of a streamed download
_SINGLE_RANGE = re.compile(r"^bytes=(\d*)-(\d*)$")


class OutputStoreUnavailable(ServerError, RuntimeError):
    """The store cannot be reached or refused the call (down, unreachable, access denied). The message names the
    store (for the operator's log); `reason` says what failed without naming the store's bucket or endpoint (for
    a client). Neither ever holds a credential."""

    code = "output_store_unavailable"

    def __init__(self, message: str, reason: str | None = None):
        super().__init__(message)
        self.reason = reason or "the output store is unreachable"


class OutputMissing(ServerError, LookupError):
    """The object is not in the store (removed behind the server's back, or never published)."""

    code = "output_missing"


class RangeNotSatisfiable(ClientError, ValueError):
    """The requested byte range lies outside the object; `total` is its size when known."""

    code = "range_not_satisfiable"

    def __init__(self, total: int | None):
        super().__init__(f"the requested range is outside the file ({total} bytes)" if total is not None
                         else "the requested range is outside the file")
        self.total = total


@dataclass(frozen=True)
class StoredObject:
    """What a HEAD says about one object."""

    size: int
    content_type: str | None = None
    etag: str | None = None


@dataclass
class ObjectRead:
    """An open download of an object, or of one byte range of it (`content_range` set: a 206)."""

    chunks: Iterator[bytes]
    length: int  # bytes in this body
    total: int  # the whole object's size
    content_type: str | None
    close: Callable[[], None]
    content_range: str | None = None  # "bytes FIRST-LAST/TOTAL" when one range was served
    etag: str | None = None
    last_modified: datetime | None = None

    def read_all(self) -> bytes:
        try:
            return b"".join(self.chunks)
        finally:
            self.close()


class OutputStore(Protocol):
    """Where published outputs live. Names are the job folder's file names (`h3serve.media.previews`):
    video.mp4, thumbnail.webp, 1.video.mp4... Every method may raise `OutputStoreUnavailable`."""

    remote: bool  # the objects live off this machine: staged files are uploaded, then removed here

    def describe(self) -> str: ...  # for logs and errors: the folder or s3://bucket/prefix (never a credential)
    def check(self) -> None: ...  # start-up: reachable and writable, else `OutputStoreUnavailable` saying why
    def upload(self, job_id: str, name: str, path: Path, content_type: str) -> None: ...
    def head(self, job_id: str, name: str) -> StoredObject | None: ...  # None: no such object
    def local_path(self, job_id: str, name: str) -> Path | None: ...  # the file on this machine, if it is one
    def read(self, job_id: str, name: str, byte_range: str | None = None) -> ObjectRead: ...  # `OutputMissing`
    def download(self, job_id: str, name: str, dest: Path) -> None: ...  # whole object into `dest` (atomic)
    def presigned_url(self, job_id: str, name: str, expires_s: int, content_type: str, filename: str
                      ) -> str | None: ...  # a time-limited GET URL; None where the store has none
    def list_names(self, job_id: str, under: str = "") -> list[str]: ...  # the job's object names below `under`
    def remove(self, job_id: str) -> None: ...  # every object of the job, and its unfinished uploads


def single_range(header: str | None, total: int) -> tuple[int, int] | None:
    """The (first, last) bytes a `Range: bytes=...` header asks of a `total`-byte file; None for no header or one
    this store serves whole (several ranges, another unit, bad syntax: RFC 9110 lets a server ignore them).
    `RangeNotSatisfiable` when it lies outside the file."""
    match = _SINGLE_RANGE.match(header.strip()) if header else None
    if match is None or match.group(1) == match.group(2) == "":
        return None
    first_text, last_text = match.groups()
    if first_text == "":  # the last N bytes
        count = int(last_text)
        if count == 0:
            raise RangeNotSatisfiable(total)
        return max(0, total - count), total - 1
    first = int(first_text)
    last = total - 1 if last_text == "" else min(int(last_text), total - 1)
    if first >= total or (last_text != "" and int(last_text) < first):
        raise RangeNotSatisfiable(total)
    return first, last
