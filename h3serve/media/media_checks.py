"""The checks of an input file that need no decoding (its bytes' type, its size) and the per-file rules a
decoder applies as it goes (edges, aspect ratio, clip duration), each raising the `MediaError` that names them."""

from __future__ import annotations

import os

from h3serve.media.media_errors import MediaDecodeError, MediaFormatError, MediaLimitError, one_line
from h3serve.media.sniff import Format, Kind, identify, read_head
from h3serve.rules import limits
from h3serve.rules.request import MediaRef

# Per-file byte limit by kind (the server applies it while storing uploads and downloads, too).
MAX_BYTES: dict[Kind, int] = {
    "image": limits.MAX_IMAGE_BYTES,
    "video": limits.MAX_VIDEO_BYTES,
    "audio": limits.MAX_AUDIO_BYTES,
}

ACCEPTED = {
    "image": "images JPEG, PNG, WEBP or HEIC/HEIF",
    "video": "videos H.264 or H.265 (MP4/MOV, MKV or MPEG-TS) with AAC, MP3 or no sound",
    "audio": "audio WAV (PCM) or MP3",
}
ACCEPTED_ANY = "; ".join(ACCEPTED.values())


def inspect_file(ref: MediaRef, field: str, expected: Kind | None) -> Format:
    """Identify the file from its bytes and check the declared kind, the expected kind and the byte size."""
    try:
        size = os.stat(ref.path).st_size
        head = read_head(ref.path)
    except OSError as exc:
        raise MediaDecodeError(
            ref.name, field, f"cannot read the file ({exc.strerror or 'I/O error'})", "a readable file"
        ) from None
    fmt = identify(head)
    if fmt is None:
        what = "the file is empty" if not head else "not a recognised image, video or audio file"
        raise MediaFormatError(ref.name, field, what, ACCEPTED.get(expected or ref.kind or "", ACCEPTED_ANY))
    if ref.kind is not None and ref.kind != fmt.kind:
        raise MediaFormatError(
            ref.name, field, f"declared as {ref.kind}, but the file is {fmt.kind} ({fmt.label})", ACCEPTED[ref.kind]
        )
    if expected is not None and expected != fmt.kind:
        raise MediaFormatError(
            ref.name, field, f"expected {expected}, but the file is {fmt.kind} ({fmt.label})", ACCEPTED[expected]
        )
    max_bytes = MAX_BYTES[fmt.kind]
    if size > max_bytes:
        raise MediaLimitError(
            ref.name, field, f"file is {size:,} bytes", f"{fmt.kind} files at most {max_bytes / 2**20:g} MiB"
        )
    return fmt


def check_aspect(ref: MediaRef, field: str, what: str, width: int, height: int) -> None:
    a, b = limits.MEDIA_MAX_ASPECT
    if width <= 0 or height <= 0 or max(width, height) * b > min(width, height) * a:
        raise MediaLimitError(
            ref.name,
            field,
            f"{what} is {width}x{height} px",
            f"aspect ratio (width:height) between {a}:{b} and {b}:{a}",
        )


def check_image_size(ref: MediaRef, field: str, width: int, height: int) -> None:
    lo, hi = limits.MEDIA_IMAGE_MIN_EDGE, limits.MEDIA_IMAGE_MAX_EDGE
    if not (lo <= width <= hi and lo <= height <= hi):
        raise MediaLimitError(ref.name, field, f"image is {width}x{height} px", f"both image edges {lo}-{hi} px")
    check_aspect(ref, field, "image", width, height)


def clip_limit() -> str:
    return f"each clip {limits.MEDIA_CLIP_MIN_S:g}-{limits.MEDIA_CLIP_MAX_S:g} s"


def check_clip_duration(ref: MediaRef, field: str, what: str, seconds: float) -> None:
    slack = limits.MEDIA_DURATION_SLACK_S
    if not limits.MEDIA_CLIP_MIN_S - slack <= seconds <= limits.MEDIA_CLIP_MAX_S + slack:
        raise MediaLimitError(ref.name, field, f"{what} is {seconds:.2f} s long", clip_limit())


def too_long(ref: MediaRef, field: str, what: str) -> MediaLimitError:
    """Raised while decoding: decoding stops as soon as a clip passes the limit, so its full length is unknown."""
    return MediaLimitError(ref.name, field, f"{what} is longer than {limits.MEDIA_CLIP_MAX_S:g} s", clip_limit())


def reason(exc: Exception, ref: MediaRef) -> str:
    """A short, single-line cause that never shows the server-side path."""
    text = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
    return one_line(str(text).replace(str(ref.path), ref.name), 120)
