"""A finished job's downloadable files: the MP4, a thumbnail and a spritesheet (h3serve.media.previews), each
written atomically."""

from __future__ import annotations

import shutil
from pathlib import Path

from h3serve.engine.output import GenerationOutput
from h3serve.media.mp4 import EncoderOptions, rgb8, write_mp4
from h3serve.media.previews import VARIANTS, preview_indices, write_previews


def discard_files(output: GenerationOutput) -> None:
    """Remove a streamed output's files (a job dropped before they were moved in)."""
    for path in output.files.values():
        Path(path).unlink(missing_ok=True)


def write_artifacts(job_dir: Path, output: GenerationOutput, encoder_options: EncoderOptions) -> None:
    """Every variant into `job_dir`; the MP4 last, so its presence means the job's files are complete.

    A streamed output's files were written by the engine already (under one folder): they are moved in."""
    job_dir.mkdir(parents=True, exist_ok=True)
    if output.files:
        for name in sorted(output.files, key=lambda n: n == "video"):
            shutil.move(output.files[name], job_dir / VARIANTS[name].file_name)
        return
    if output.video is None:
        raise ValueError("the output has neither frames nor files")
    # The previews show the MP4's own pixels (its rounding), whichever way the video was decoded.
    frames = {i: rgb8(output.video[i]) for i in set(preview_indices(len(output.video)))}
    write_previews(job_dir, frames, len(output.video))
    write_mp4(job_dir / VARIANTS["video"].file_name, output.video, output.audio, options=encoder_options)
