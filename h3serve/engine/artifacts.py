"""A finished job's downloadable files: the MP4, a thumbnail and a spritesheet, each written atomically."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from h3serve.engine.output import GenerationOutput
from h3serve.media.mp4 import EncoderOptions, rgb8, write_mp4
from h3serve.media.raw import atomic_output


@dataclass(frozen=True)
class Variant:
    file_name: str
    media_type: str
    extension: str


# The OpenAI download variants: the video itself, a WebP thumbnail, and a JPEG sheet of frames.
VARIANTS: dict[str, Variant] = {
    "video": Variant("video.mp4", "video/mp4", "mp4"),
    "thumbnail": Variant("thumbnail.webp", "image/webp", "webp"),
    "spritesheet": Variant("spritesheet.jpg", "image/jpeg", "jpg"),
}
SPRITE_COLUMNS = 5
SPRITE_ROWS = 2
SPRITE_TILE_MAX_WIDTH = 256


def preview_indices(num_frames: int, columns: int = SPRITE_COLUMNS, rows: int = SPRITE_ROWS) -> list[int]:
    """The frames the previews show: the thumbnail's (the middle one) first, then the spritesheet's
    `columns x rows` evenly spaced ones (fewer for a shorter video)."""
    count = min(columns * rows, num_frames)
    return [num_frames // 2, *np.linspace(0, num_frames - 1, count).round().astype(int).tolist()]


def thumbnail(frame: np.ndarray) -> Image.Image:
    """The middle frame (uint8 RGB) at full size (the first frame of an FL2VA video is the user's own keyframe)."""
    return Image.fromarray(frame)


def spritesheet(frames: list[np.ndarray], columns: int = SPRITE_COLUMNS) -> Image.Image:
    """The sprite frames (uint8 RGB) left to right then top to bottom, each at most 256 px wide."""
    height, width = frames[0].shape[:2]
    tile_w = min(width, SPRITE_TILE_MAX_WIDTH)
    tile_h = max(1, round(height * tile_w / width))
    sheet = Image.new("RGB", (tile_w * columns, tile_h * -(-len(frames) // columns)))
    for slot, frame in enumerate(frames):
        tile = Image.fromarray(frame).resize((tile_w, tile_h), Image.Resampling.LANCZOS)
        sheet.paste(tile, ((slot % columns) * tile_w, (slot // columns) * tile_h))
    return sheet


def _save_image(image: Image.Image, path: Path, fmt: str, **options) -> None:
    with atomic_output(path) as tmp:
        image.save(tmp, format=fmt, **options)


def write_previews(
    folder: Path, frames: dict[int, np.ndarray], num_frames: int, prefix: str = ""
) -> dict[str, Path]:
    """The thumbnail and the spritesheet from `frames` (uint8, by index: at least `preview_indices`'), written
    into `folder` (file names after `prefix`); their paths by variant."""
    thumb, *sprite = preview_indices(num_frames)
    paths = {name: folder / f"{prefix}{VARIANTS[name].file_name}" for name in ("thumbnail", "spritesheet")}
    _save_image(thumbnail(frames[thumb]), paths["thumbnail"], "WEBP", quality=85)
    _save_image(spritesheet([frames[i] for i in sprite]), paths["spritesheet"], "JPEG", quality=85)
    return paths


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
