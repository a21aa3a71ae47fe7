"""A finished job's downloadable files: the MP4, a thumbnail and a spritesheet, each written atomically."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from h3serve.engine.output import GenerationOutput
from h3serve.media.mp4 import EncoderOptions, write_mp4
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


def _to_uint8(frame: np.ndarray) -> np.ndarray:
    return (np.clip(frame, 0.0, 1.0) * 255.0 + 0.5).astype(np.uint8)


def thumbnail(video: np.ndarray) -> Image.Image:
    """The middle frame at full size (the first frame of an FL2VA video is the user's own keyframe)."""
    return Image.fromarray(_to_uint8(video[len(video) // 2]))


def spritesheet(video: np.ndarray, columns: int = SPRITE_COLUMNS, rows: int = SPRITE_ROWS) -> Image.Image:
    """`columns x rows` evenly spaced frames, left to right then top to bottom, each at most 256 px wide."""
    count = min(columns * rows, len(video))
    indices = np.linspace(0, len(video) - 1, count).round().astype(int)
    height, width = video.shape[1:3]
    tile_w = min(width, SPRITE_TILE_MAX_WIDTH)
    tile_h = max(1, round(height * tile_w / width))
    sheet = Image.new("RGB", (tile_w * columns, tile_h * -(-count // columns)))
    for slot, index in enumerate(indices):
        tile = Image.fromarray(_to_uint8(video[index])).resize((tile_w, tile_h), Image.Resampling.LANCZOS)
        sheet.paste(tile, ((slot % columns) * tile_w, (slot // columns) * tile_h))
    return sheet


def _save_image(image: Image.Image, path: Path, fmt: str, **options) -> None:
    with atomic_output(path) as tmp:
        image.save(tmp, format=fmt, **options)


def write_artifacts(job_dir: Path, output: GenerationOutput, encoder_options: EncoderOptions) -> None:
    """Write every variant into `job_dir`; the MP4 last, so its presence means the job's files are complete."""
    job_dir.mkdir(parents=True, exist_ok=True)
    _save_image(thumbnail(output.video), job_dir / VARIANTS["thumbnail"].file_name, "WEBP", quality=85)
    _save_image(spritesheet(output.video), job_dir / VARIANTS["spritesheet"].file_name, "JPEG", quality=85)
    write_mp4(job_dir / VARIANTS["video"].file_name, output.video, output.audio, options=encoder_options)
