"""A video's previews as the OpenAI Videos API offers them beside the MP4: a WebP thumbnail (the middle frame) and a
JPEG sheet of evenly spaced frames; the variants' file names and media types."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

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


def output_prefix(index: int) -> str:
    """File names of output `index` of several start with this (output 0's are the plain variant names)."""
    return "" if index == 0 else f"{index}."


def output_file_name(variant: str, index: int = 0) -> str:
    """The file of `variant` of output `index` in a job's folder: video.mp4, 1.video.mp4, 2.thumbnail.webp..."""
    return f"{output_prefix(index)}{VARIANTS[variant].file_name}"


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
