"""Media type from the first bytes of a file (magic numbers), never from its name or a declared content type.

`identify` names the container format as well as the kind, so that a known but unsupported format (GIF, FLAC,
WebM, ...) gets a precise error instead of "unrecognised file".
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal

Kind = Literal["image", "video", "audio"]

HEAD_BYTES = 512  # enough for every signature below, including three MPEG-TS sync bytes 188 apart

_HEIF_BRANDS = {b"heic", b"heix", b"heim", b"heis", b"hevc", b"hevx", b"hevm", b"hevs", b"mif1", b"msf1"}
_AVIF_BRANDS = {b"avif", b"avis"}
_AUDIO_MP4_BRANDS = {b"M4A ", b"M4B ", b"M4P "}


@dataclass(frozen=True)
class Format:
    kind: Kind
    name: str  # "jpeg", "png", "webp", "heif", "mp4", "matroska", "mpegts", "wav", "mp3", or an unsupported one
    label: str  # how a user knows it, for error messages


def _ftyp(head: bytes) -> Format | None:
    """ISO base media files (MP4, MOV, HEIF, AVIF, M4A): the `ftyp` box lists a major brand and compatible ones."""
    if len(head) < 12 or head[4:8] != b"ftyp":
        return None
    size = int.from_bytes(head[0:4], "big")
    major = head[8:12]
    brands = {major} | {head[i : i + 4] for i in range(16, min(size, len(head)) - 3, 4)}
    if major in _AVIF_BRANDS or (major in {b"mif1", b"msf1"} and brands & _AVIF_BRANDS):
        return Format("image", "avif", "AVIF")
    if major in _HEIF_BRANDS:
        return Format("image", "heif", "HEIC/HEIF")
    if major in _AUDIO_MP4_BRANDS:
        return Format("audio", "m4a", "M4A")
    return Format("video", "mp4", "MP4/MOV")


def _mp3_frame(head: bytes) -> bool:
    """An MPEG audio frame header: 11 sync bits, a valid version, and layer III (AAC/ADTS has layer bits 00)."""
    return (
        len(head) >= 2
        and head[0] == 0xFF
        and head[1] & 0xE0 == 0xE0
        and (head[1] >> 3) & 3 != 1
        and (head[1] >> 1) & 3 == 1
    )


def identify(head: bytes) -> Format | None:
    """The format of a file whose first bytes are `head`, or None if no known signature matches."""
    if head.startswith(b"\xff\xd8\xff"):
        return Format("image", "jpeg", "JPEG")
    if head.startswith(b"\x89PNG\r\n\x1a\n"):
        return Format("image", "png", "PNG")
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return Format("image", "webp", "WEBP")
    if head[:4] == b"RIFF" and head[8:12] == b"WAVE":
        return Format("audio", "wav", "WAV")
    if head[:4] == b"RIFF" and head[8:12] == b"AVI ":
        return Format("video", "avi", "AVI")
    if fmt := _ftyp(head):
        return fmt
    if head.startswith(b"\x1a\x45\xdf\xa3"):
        return Format("video", "matroska", "Matroska/WebM")
    if len(head) > 376 and head[0] == head[188] == head[376] == 0x47:
        return Format("video", "mpegts", "MPEG-TS")
    if head.startswith(b"ID3") or _mp3_frame(head):
        return Format("audio", "mp3", "MP3")
    if head.startswith(b"\xff\xf1") or head.startswith(b"\xff\xf9"):
        return Format("audio", "aac", "AAC (ADTS)")
    if head.startswith(b"fLaC"):
        return Format("audio", "flac", "FLAC")
    if head.startswith(b"OggS"):
        return Format("audio", "ogg", "Ogg")
    if head.startswith((b"GIF87a", b"GIF89a")):
        return Format("image", "gif", "GIF")
    if head.startswith(b"BM"):
        return Format("image", "bmp", "BMP")
    if head.startswith((b"II*\x00", b"MM\x00*")):
        return Format("image", "tiff", "TIFF")
    return None


def read_head(path: str | os.PathLike[str]) -> bytes:
    with open(path, "rb") as f:
        return f.read(HEAD_BYTES)


def sniff(path: str | os.PathLike[str]) -> Kind | None:
    """ "image", "video" or "audio" from the file's magic bytes; None if unknown or unreadable."""
    try:
        fmt = identify(read_head(path))
    except OSError:
        return None
    return fmt.kind if fmt else None
