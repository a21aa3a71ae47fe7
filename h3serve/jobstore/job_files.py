"""Job files on disk: one folder per job under the data dir, with a path-traversal guard.

Layout: `<root>/<job id>/inputs/...` (uploads and URL downloads) and `<root>/<job id>/<artifact>` (outputs).
Every file in them is written with `h3serve.media.raw.atomic_output` (temporary name, fsync, rename), so a
crash never leaves a half-written file under its final name.
"""

from __future__ import annotations

import re
import shutil
import time
from pathlib import Path

from h3serve.errors import ClientError

JOB_ID_PATTERN = re.compile(r"^video_[0-9a-f]{32}$")
INPUTS_DIR = "inputs"


class UnsafePathError(ClientError, ValueError):
    """A name would escape its folder (`..`, a separator, an absolute path) or is not a job id."""

    code = "invalid_request"


def safe_child(parent: Path, name: str) -> Path:
    """`parent / name`, refusing any name that does not stay directly inside `parent`."""
    if not name or name in (".", "..") or "/" in name or "\\" in name or "\x00" in name:
        raise UnsafePathError(f"unsafe file name {name!r}")
    child = parent / name
    if child.resolve().parent != parent.resolve():
        raise UnsafePathError(f"unsafe file name {name!r}")
    return child


class JobFiles:
    """The folders of every job under `root`. Job ids are checked against `JOB_ID_PATTERN` before any join."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def job_dir(self, job_id: str) -> Path:
        if not JOB_ID_PATTERN.match(job_id):
            raise UnsafePathError(f"not a job id: {job_id!r}")
        return safe_child(self.root, job_id)

    def inputs_dir(self, job_id: str) -> Path:
        folder = self.job_dir(job_id) / INPUTS_DIR
        folder.mkdir(parents=True, exist_ok=True)
        return folder

    def file(self, job_id: str, name: str) -> Path:
        return safe_child(self.job_dir(job_id), name)

    def remove(self, job_id: str) -> None:
        """Delete the job's folder and everything in it (a missing folder is fine)."""
        shutil.rmtree(self.job_dir(job_id), ignore_errors=True)

    def job_ids(self, older_than_s: float = 0.0) -> set[str]:
        """Ids of every job folder on disk (other entries are ignored); with `older_than_s`, only folders not
        modified for that long (on a shared data dir another server may be writing a job it has not stored yet)."""
        cutoff = time.time() - older_than_s
        return {
            p.name for p in self.root.iterdir()
            if p.is_dir() and JOB_ID_PATTERN.match(p.name) and (not older_than_s or p.stat().st_mtime < cutoff)
        }
