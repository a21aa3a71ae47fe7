"""A job's staged outputs: the files written into its folder in the data dir, and their manifest (`.staged.json`:
the file names, their media types and the completion's fields), written once all of them are when they go on to a
bucket. A job claimed again with its manifest and files present is published from them instead of being run again
(publishing.py); with the data dir store (published as soon as written) a job that did not finish runs again."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from h3serve.media.raw import atomic_output

STAGED_MANIFEST = ".staged.json"


@dataclass(frozen=True)
class Staged:
    """A job's written outputs: file name -> media type (in writing order: output 0's MP4 last) and the fields
    its completion records."""

    files: dict[str, str]
    completion: dict[str, Any]

    def save(self, job_dir: Path) -> None:
        with atomic_output(job_dir / STAGED_MANIFEST) as tmp:
            tmp.write_text(json.dumps({"files": self.files, "completion": self.completion}))

    @classmethod
    def load(cls, job_dir: Path) -> Staged | None:
        """The manifest, if every file it names is still there; else None (the job runs again)."""
        try:
            data = json.loads((job_dir / STAGED_MANIFEST).read_text())
            staged = cls(dict(data["files"]), dict(data["completion"]))
        except (OSError, ValueError, KeyError, TypeError):
            return None
        return staged if all((job_dir / name).is_file() for name in staged.files) else None
