"""Small media files for the browser tests, made in memory: PNG images and WAV clips."""

from __future__ import annotations

import io
import math
import struct
import wave

from PIL import Image


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
