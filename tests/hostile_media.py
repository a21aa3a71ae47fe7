"""Media files the tests make themselves: small valid clips, and the hostile ones an audit posts (decompression
bombs: a tiny file whose header asks for a huge canvas)."""

from __future__ import annotations

import struct
import subprocess
import zlib
from pathlib import Path


def h264_clip(path: Path, width: int, height: int, frames: int = 1, fps: int = 24) -> Path:
    """An H.264 MP4 of `frames` black frames of `width` x `height` (libx264 ultrafast: an 8192x8192 frame is ~200 KB
    and takes seconds; a 4608x4608 one about a second)."""
    subprocess.run(
        ["ffmpeg", "-hide_banner", "-loglevel", "error", "-y", "-f", "lavfi", "-i",
         f"color=black:size={width}x{height}:rate={fps}", "-frames:v", str(frames), "-c:v", "libx264",
         "-preset", "ultrafast", "-pix_fmt", "yuv420p", str(path)],
        check=True, timeout=120,
    )
    return path


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def png_bomb(path: Path, width: int, height: int, truncated: bool = False) -> Path:
    """A gray 8-bit PNG of `width` x `height` zeros, written a row band at a time (a 12000x12000 one is ~140 KB and
    never exists in memory here); `truncated`: the header and the start of the pixel data only (a file whose header
    lies: ~50 bytes for any size)."""
    with open(path, "wb") as f:
        f.write(b"\x89PNG\r\n\x1a\n")
        f.write(_chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)))
        if truncated:  # an IDAT chunk that says 1 MB and ends after its first bytes
            f.write(struct.pack(">I", 1 << 20) + b"IDAT" + zlib.compressobj(1).compress(b"\x00" * 64))
        else:
            packer = zlib.compressobj(1)
            row = b"\x00" * (width + 1)  # filter byte 0, then the row
            band = row * max(1, (1 << 22) // len(row))
            data, rows = bytearray(), 0
            while rows < height:
                take = min(height - rows, len(band) // len(row))
                data += packer.compress(band[: take * len(row)])
                rows += take
            data += packer.flush()
            f.write(_chunk(b"IDAT", bytes(data)))
            f.write(_chunk(b"IEND", b""))
    return path
