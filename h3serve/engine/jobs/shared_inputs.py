"""A shared queue without a shared disk: servers on one PostgreSQL job store whose outputs go to one bucket keep
their own data dirs, so a job's input files (uploads, downloaded media URLs, a remix's source MP4) go to the bucket
too, under `PREFIX/<job id>/inputs/`, before the job is queued. The server that claims it, if it is not the one
that stored them, fetches them into its own job folder and plans the job on those paths.

Only files of the job's own `inputs` folder travel; a path the operator allowed (`--control-dir`) is the same on
every server and is left as it is.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from h3serve.jobstore.job_files import INPUTS_DIR, JobFiles
from h3serve.jobstore.records import Job
from h3serve.output_store.interface import OutputStore, OutputStoreUnavailable
from h3serve.rules.request import ControlRequest, GenerationRequest, MediaRef

log = logging.getLogger("h3serve.jobs")
INPUTS_PREFIX = f"{INPUTS_DIR}/"


class SharedInputs:
    """Puts a job's inputs into the bucket at submission and fetches them where the job is claimed."""

    def __init__(self, files: JobFiles, outputs: OutputStore, shared_queue: bool):
        self.files = files
        self.outputs = outputs
        self.active = shared_queue and outputs.remote  # else every server that may run a job has its files

    def share(self, job: Job) -> None:
        """Upload the job's input files (none for a text-only job). `OutputStoreUnavailable` if the bucket cannot
        take them; what went up is removed again."""
        if not self.active or job.sync:  # a sync job runs only where its client waits
            return
        folder = self.files.job_dir(job.id) / INPUTS_DIR
        paths = sorted(p for p in folder.iterdir() if p.is_file()) if folder.is_dir() else []
        try:
            for path in paths:
                self.outputs.upload(job.id, INPUTS_PREFIX + path.name, path, "application/octet-stream")
        except OutputStoreUnavailable:
            self.unshare(job.id)
            raise

    def unshare(self, job_id: str) -> None:
        """Remove a job's shared inputs (its submission failed after `share`); never raises."""
        try:
            self.outputs.remove(job_id)
        except OutputStoreUnavailable as e:
            log.warning("job %s: its shared inputs stay in the bucket: %s", job_id, e)

    def localized(self, job: Job) -> GenerationRequest:
        """The job's request with its input files on this server: each file of its `inputs` folder in another
        server's data dir is fetched from the bucket into this data dir's job folder. `OutputMissing` if one is not
        there."""
        request = job.request
        if not self.active:
            return request
        folder = self.files.job_dir(job.id) / INPUTS_DIR

        def local(ref: MediaRef) -> MediaRef:
            path = Path(ref.path)
            if path.parent.name != INPUTS_DIR or path.parent.parent.name != job.id or path.parent == folder:
                return ref  # not one of the job's stored inputs, or already in this data dir
            dest = self.files.inputs_dir(job.id) / path.name
            if not dest.is_file():
                self.outputs.download(job.id, INPUTS_PREFIX + path.name, dest)
            return dataclasses.replace(ref, path=dest)

        localized = _map_media(request, local)
        if localized != request:
            log.info("job %s: fetched its inputs from %s into %s", job.id, self.outputs.describe(), folder)
        return localized


def _map_media(request: GenerationRequest, change: Callable[[MediaRef], MediaRef]) -> GenerationRequest:
    """`request` with `change` applied to every `MediaRef` in it (keyframes, references, sources, controls)."""

    def walk(value: Any) -> Any:
        if isinstance(value, MediaRef):
            return change(value)
        if isinstance(value, ControlRequest):
            return dataclasses.replace(value, **{f.name: walk(getattr(value, f.name))
                                                 for f in dataclasses.fields(value)})
        if isinstance(value, tuple):
            return tuple(walk(v) for v in value)
        return value

    return dataclasses.replace(request, **{f.name: walk(getattr(request, f.name))
                                           for f in dataclasses.fields(request)})
