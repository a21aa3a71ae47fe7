"""A finished job's downloadable files: the MP4, a thumbnail and a spritesheet (h3serve.media.previews), each
written atomically; per output of a several-output job (`output_file_name`)."""

from __future__ import annotations

import shutil
from pathlib import Path

from h3serve.media.mp4 import EncoderOptions, rgb8, write_mp4
from h3serve.media.previews import VARIANTS, output_file_name, output_prefix, preview_indices, write_previews
from h3serve.messages import GenerationOutput


def discard_files(output: GenerationOutput) -> None:
    """Remove a streamed output's files (a job dropped before they were moved in), every output's."""
    for media in output.outputs:
        for path in media.files.values():
            Path(path).unlink(missing_ok=True)


def write_artifacts(job_dir: Path, output: GenerationOutput, encoder_options: EncoderOptions) -> dict[str, str]:
    """Every variant of every output into `job_dir`; output 0's MP4 last, so its presence means the job's files
    are complete. The files written (their names in `job_dir`) and their media types, in writing order."""
    job_dir.mkdir(parents=True, exist_ok=True)
    written: dict[str, str] = {}
    for index in reversed(range(len(output.outputs))):
        written.update(_write_output(job_dir, output.outputs[index], index, encoder_options))
    return written


def _write_output(job_dir: Path, output: GenerationOutput, index: int, encoder_options: EncoderOptions
                  ) -> dict[str, str]:
    """One output's variants, its MP4 last. A streamed output's files were written by the engine already (under
    one folder): they are moved in."""
    if output.files:
        variants = sorted(output.files, key=lambda n: n == "video")
        for name in variants:
            shutil.move(output.files[name], job_dir / output_file_name(name, index))
        return {output_file_name(name, index): VARIANTS[name].media_type for name in variants}
    if output.video is None:
        raise ValueError("the output has neither frames nor files")
    # The previews show the MP4's own pixels (its rounding), whichever way the video was decoded.
    frames = {i: rgb8(output.video[i]) for i in set(preview_indices(len(output.video)))}
    write_previews(job_dir, frames, len(output.video), prefix=output_prefix(index))
    if output.audio is None:
        raise ValueError("the output has frames but no soundtrack")
    write_mp4(job_dir / output_file_name("video", index), output.video, output.audio, options=encoder_options)
    return {output_file_name(name, index): VARIANTS[name].media_type for name in ("thumbnail", "spritesheet", "video")}
