"""Small media files for the browser tests: PNG images, WAV clips and an H.264 + AAC MP4."""

from __future__ import annotations

import io
import math
import struct
import wave

import numpy as np
from PIL import Image

from h3serve.media.mp4 import EncoderOptions, write_mp4


def png(width: int, height: int, color: tuple[int, int, int] = (200, 80, 40)) -> bytes:
    image = Image.new("RGB", (width, height), color)
    for x in range(0, width, 16):  # some structure, so the keyframe is not a flat colour
        image.paste((color[2], color[0], color[1]), (x, 0, x + 8, height))
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def wav(seconds: float, rate: int = 32_000, channels: int = 2, hz: float = 440.0) -> bytes:
    frames = int(seconds * rate)
    samples = (int(8000 * math.sin(2 * math.pi * hz * i / rate)) for i in range(frames))
    data = b"".join(struct.pack("<h", s) * channels for s in samples)
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(data)
    return out.getvalue()


def mp4(path, seconds: float, width: int = 320, height: int = 192) -> bytes:
    """A clip at 24 fps: a bar sweeping across, with a tone."""
    frames = round(seconds * 24)
    video = np.zeros((frames, height, width, 3), np.float32)
    for t in range(frames):
        x = t * width // frames
        video[t, :, x : x + 16] = (1.0, 0.8, 0.2)
    n = round(seconds * 32_000)
    tone = 0.2 * np.sin(2 * np.pi * 330 * np.arange(n) / 32_000, dtype=np.float32)
    write_mp4(path, video, np.stack([tone, tone]), options=EncoderOptions(preset="ultrafast"))
    return path.read_bytes()
