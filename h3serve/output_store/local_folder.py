"""The default output store: each job's folder in the data dir (`h3serve.jobstore.job_files`), where the outputs
are written in the first place. Publishing there is a check that the files exist; downloads are served from the
files (the HTTP layer's file response handles ranges itself)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import BinaryIO

from h3serve.jobstore.job_files import JobFiles, safe_child
from h3serve.media.raw import atomic_output
from h3serve.output_store.interface import CHUNK_BYTES, ObjectRead, OutputMissing, StoredObject, single_range


class LocalFolderStore:
    """Outputs in `files`' job folders on this machine (or on a shared mount every server sees at one path)."""

    remote = False

    def __init__(self, files: JobFiles):
        self.files = files

    def describe(self) -> str:
        return f"the data dir {self.files.root}"

    def check(self) -> None:
        """The folder exists (`JobFiles` made it); writing into it is checked by the data dir's own start-up."""

    def _path(self, job_id: str, name: str) -> Path:
        """The file of object `name` (`video.mp4`, `inputs/00-cat.png`), every part checked to stay inside."""
        path = self.files.job_dir(job_id)
        for part in name.split("/"):
            path = safe_child(path, part)
        return path

    def upload(self, job_id: str, name: str, path: Path, content_type: str) -> None:
        """The files are written in place; a file staged elsewhere is moved in."""
        dest = self._path(job_id, name)
        if Path(path).resolve() != dest.resolve():
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.move(path, dest)

    def head(self, job_id: str, name: str) -> StoredObject | None:
        try:
            return StoredObject(size=self._path(job_id, name).stat().st_size)
        except FileNotFoundError:
            return None

    def local_path(self, job_id: str, name: str) -> Path | None:
        path = self._path(job_id, name)
        return path if path.is_file() else None

    def read(self, job_id: str, name: str, byte_range: str | None = None) -> ObjectRead:
        path = self._path(job_id, name)
        try:
            handle = open(path, "rb")  # noqa: SIM115 (closed by the reader's `close`)
        except FileNotFoundError:
            raise OutputMissing(f"{name} of {job_id} is not in {self.describe()}") from None
        stat = os.fstat(handle.fileno())
        try:
            span = single_range(byte_range, stat.st_size)
        except Exception:
            handle.close()
            raise
        first, last = span if span is not None else (0, stat.st_size - 1)
        handle.seek(first)
        return ObjectRead(
            chunks=_chunks(handle, last - first + 1), length=last - first + 1, total=stat.st_size,
            content_type=None, close=handle.close,
            content_range=None if span is None else f"bytes {first}-{last}/{stat.st_size}",
            last_modified=datetime.fromtimestamp(stat.st_mtime, UTC),
        )

    def download(self, job_id: str, name: str, dest: Path) -> None:
        source = self._path(job_id, name)
        if not source.is_file():
            raise OutputMissing(f"{name} of {job_id} is not in {self.describe()}")
        with atomic_output(dest) as tmp:
            shutil.copyfile(source, tmp)

    def presigned_url(self, job_id: str, name: str, expires_s: int, content_type: str, filename: str) -> None:
        return None

    def list_names(self, job_id: str, under: str = "") -> list[str]:
        folder = self.files.job_dir(job_id) / under if under else self.files.job_dir(job_id)
        if not folder.is_dir():
            return []
        return sorted(f"{under}{p.name}" for p in folder.iterdir() if p.is_file() and not p.name.startswith("."))

    def remove(self, job_id: str) -> None:
        self.files.remove(job_id)


def _chunks(handle: BinaryIO, length: int) -> Iterator[bytes]:
    left = length
    while left > 0:
        chunk = handle.read(min(CHUNK_BYTES, left))
        if not chunk:
            return
        left -= len(chunk)
        yield chunk
