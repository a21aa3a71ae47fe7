"""Fragmented MP4 in the tests: synthetic chunks to feed a writer, and the readers that check what came out
(top-level boxes, the key flag of a fragment's first picture, a decode with PyAV, ffprobe's stream report)."""

from __future__ import annotations

import json
import struct
import subprocess
from pathlib import Path

import av
import numpy as np

FPS, RATE = 24, 32_000


def chunk_samples(first_frame: int, frames: int) -> int:
    """Audio samples of frames [first_frame, first_frame + frames) on the 24 fps grid (rounded per boundary)."""
    return (first_frame + frames) * RATE // FPS - first_frame * RATE // FPS


def synthetic_chunk(first_frame: int, frames: int, height: int, width: int) -> tuple[np.ndarray, np.ndarray]:
    """Smooth moving RGB gradients (uint8 [F, H, W, 3]) and a stereo sine pair (float32 [S, 2]) for the frames
    from `first_frame` on: consecutive chunks join into one continuous clip."""
    t = np.arange(first_frame, first_frame + frames, dtype=np.float32)[:, None, None]
    y = np.arange(height, dtype=np.float32)[None, :, None] / height
    x = np.arange(width, dtype=np.float32)[None, None, :] / width
    shape = (frames, height, width)
    r = np.broadcast_to(0.5 + 0.4 * np.sin(np.pi * (x + t / 25)), shape)
    g = np.broadcast_to(0.1 + 0.8 * y, shape)
    b = 0.5 + 0.4 * np.cos(np.pi * (y + x - t / 35))
    video = np.clip(np.rint(np.stack([r, g, b], axis=-1) * 255), 0, 255).astype(np.uint8)
    start = first_frame * RATE // FPS
    s = np.arange(start, start + chunk_samples(first_frame, frames)) / RATE
    audio = np.stack([0.5 * np.sin(2 * np.pi * 440 * s), 0.3 * np.sin(2 * np.pi * 660 * s)], axis=1)
    return video, audio.astype(np.float32)


def top_boxes(data: bytes) -> list[tuple[bytes, bytes]]:
    """(type, whole box) of each top-level box; the sizes must tile `data` exactly."""
    boxes, at = [], 0
    while at < len(data):
        size, kind = struct.unpack(">I4s", data[at : at + 8])
        assert size >= 8 and at + size <= len(data), f"box {kind!r} at {at} overruns the data"
        boxes.append((kind, data[at : at + size]))
        at += size
    return boxes


def children(box: bytes, header: int = 8) -> list[tuple[bytes, bytes]]:
    return top_boxes(box[header:])


def split_init(first_segment: bytes) -> tuple[bytes, bytes]:
    """(ftyp + moov, the fragment after them) of a session's first segment."""
    kinds = [kind for kind, _ in top_boxes(first_segment)]
    assert kinds[:2] == [b"ftyp", b"moov"], kinds
    cut = sum(len(b) for _, b in top_boxes(first_segment)[:2])
    return first_segment[:cut], first_segment[cut:]


def first_picture_is_key(fragment: bytes, video_track: int = 1) -> bool:
    """Whether the first video sample of a moof + mdat fragment is a sync sample (trun's per-sample flags)."""
    (kind, moof), *_ = top_boxes(fragment)
    assert kind == b"moof"
    for kind, traf in children(moof):
        if kind != b"traf":
            continue
        parts = dict(children(traf))
        if struct.unpack(">I", parts[b"tfhd"][12:16])[0] != video_track:
            continue
        trun = parts[b"trun"]
        flags = struct.unpack(">I", trun[8:12])[0] & 0xFFFFFF
        assert flags & 0x400, "trun without per-sample flags"
        skip = 4 * bool(flags & 0x100) + 4 * bool(flags & 0x200)  # duration, size before the flags
        first = 20 + skip  # header 8 + version/flags 4 + count 4 + data offset 4
        return not struct.unpack(">I", trun[first : first + 4])[0] & 0x10000
    raise AssertionError("no video track in the fragment")


def decode(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """All video frames as uint8 RGB [T, H, W, 3] and all audio as float32 [2, N] (PyAV)."""
    with av.open(str(path)) as c:
        frames = [f.to_ndarray(format="rgb24") for f in c.decode(video=0)]
    with av.open(str(path)) as c:
        chunks = [f.to_ndarray() for f in c.decode(audio=0)]
    return np.stack(frames), np.concatenate(chunks, axis=1)


def ffprobe_streams(path: Path) -> dict[str, dict]:
    out = subprocess.run(
        ["ffprobe", "-v", "error", "-count_frames", "-show_streams", "-of", "json", str(path)],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    return {s["codec_type"]: s for s in json.loads(out)["streams"]}


def ffmpeg_errors(path: Path) -> str:
    """What a full decode by ffmpeg reports at level error ("" when clean)."""
    proc = subprocess.run(["ffmpeg", "-nostdin", "-v", "error", "-i", str(path), "-f", "null", "-"],
                          capture_output=True, text=True)
    return proc.stderr if proc.returncode == 0 else f"exit {proc.returncode}: {proc.stderr}"
