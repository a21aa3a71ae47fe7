"""The pixel budget of a decoded upload, checked from its header before anything beyond the header is decoded.

Every decoded upload (keyframes and references, edit and extension sources, ControlNet control videos, sources
and masks) passes here: a video's frame size is read with FFmpeg's stream probe told to skip every frame (a plain
open decodes the first frames to learn their format: 158 MiB for one 8192x8192 frame), an image's from its
header by PIL. A frame over `MEDIA_MAX_FRAME_PIXELS` (or an edge over `MEDIA_IMAGE_MAX_EDGE`) is refused naming
the field and the limit; so is a stream whose header states more frames than a consumer would decode within
`MEDIA_VIDEO_MAX_DECODED_BYTES`. As frames decode, `DecodedPixels` applies the same limits to each frame (a header
may lie, and a stream may change size) and counts the total, so no upload decodes past the budget.
"""

from __future__ import annotations

from dataclasses import dataclass

import av
from PIL import Image

from h3serve.media.media_checks import reason
from h3serve.media.media_errors import MediaDecodeError, MediaError, MediaFormatError, MediaLimitError
from h3serve.rules import limits
from h3serve.rules.request import MediaRef

# Options for the decoders FFmpeg's stream probe (avformat_find_stream_info) opens: they skip every frame, so
# opening a file reads its headers only. The decoders that later decode the frames are PyAV's own, without them.
HEADER_ONLY = {"skip_frame": "all"}
_MAX_EDGE = limits.MEDIA_IMAGE_MAX_EDGE


def frame_limit() -> str:
    return (f"frames and masks at most {limits.MEDIA_MAX_FRAME_PIXELS:,} pixels "
            f"(4096x2304), no edge over {_MAX_EDGE} px")


def check_frame_size(ref: MediaRef, field: str, what: str, width: int, height: int) -> None:
    """`MediaLimitError` unless a `what` ("video", "mask") of `width` x `height` is within the frame budget."""
    if width <= 0 or height <= 0:
        raise MediaDecodeError(ref.name, field, f"the {what} states no frame size", "a complete, valid file")
    if width * height > limits.MEDIA_MAX_FRAME_PIXELS or max(width, height) > _MAX_EDGE:
        raise MediaLimitError(ref.name, field, f"{what} frames are {width}x{height} px", frame_limit())


@dataclass(frozen=True)
class VideoHeader:
    width: int
    height: int
    frames: int | None  # as the container states it (None: not stated)
    fps: float | None  # the stream's average rate, if stated


def video_header(ref: MediaRef, field: str, demuxer: str | None = None, total: bool = True,
                 max_frames: int | None = None) -> VideoHeader:
    """The first video stream's header, within the budget; `MediaError` naming the field otherwise, with nothing
    decoded. `total`: the frames the header states count against the decoded total too (a consumer that decodes
    every frame into memory), at most `max_frames` of them (a consumer that stops there). Edit and extension
    sources stream each frame onto the canvas: only their frame size is checked."""
    try:
        with av.open(str(ref.path), format=demuxer, options=HEADER_ONLY) as container:
            if not container.streams.video:
                raise MediaFormatError(ref.name, field, "the file has no video stream", "a video file")
            stream = container.streams.video[0]
            width, height = stream.codec_context.width, stream.codec_context.height
            rate = stream.average_rate or stream.guessed_rate
            header = VideoHeader(width, height, stream.frames or None, float(rate) if rate and rate > 0 else None)
    except MediaError:
        raise
    except Exception as exc:
        raise MediaDecodeError(ref.name, field, f"cannot read the video's header ({reason(exc, ref)})",
                               "a complete, valid file") from None
    check_frame_size(ref, field, "video", header.width, header.height)
    frames = header.frames if max_frames is None else min(header.frames or max_frames, max_frames)
    if total and frames is not None:
        _check_total(ref, field, header.width * header.height * frames * 3, f"{frames:,} frames of "
                     f"{header.width}x{header.height} px")
    return header


def image_header(ref: MediaRef, field: str, what: str = "mask") -> tuple[int, int]:
    """An image's (width, height) from its header, within the frame budget (PIL reads no pixel to tell)."""
    try:
        with Image.open(ref.path) as image:
            size = image.size
    except Image.DecompressionBombError:  # PIL's own bound (twice its MAX_IMAGE_PIXELS) met first
        raise MediaLimitError(ref.name, field, f"the {what} image has too many pixels", frame_limit()) from None
    except Exception as exc:
        raise MediaDecodeError(ref.name, field, f"cannot read the {what} image ({reason(exc, ref)})",
                               "a complete, valid image") from None
    check_frame_size(ref, field, what, *size)
    return size


def _check_total(ref: MediaRef, field: str, nbytes: int, what: str) -> None:
    if nbytes > limits.MEDIA_VIDEO_MAX_DECODED_BYTES:
        raise MediaLimitError(
            ref.name, field, f"the video decodes to too many pixels ({what})",
            f"at most {limits.MEDIA_VIDEO_MAX_DECODED_BYTES / 2**30:g} GiB of decoded RGB frames",
        )


class DecodedPixels:
    """The budget applied as frames decode: each frame's size (before it is converted to an array) and, with
    `total`, what was decoded so far."""

    def __init__(self, ref: MediaRef, field: str, total: bool = True):
        self.ref, self.field, self.total = ref, field, total
        self.nbytes = 0

    def add(self, frame: av.VideoFrame) -> None:
        check_frame_size(self.ref, self.field, "video", frame.width, frame.height)
        self.nbytes += frame.width * frame.height * 3
        if self.total:
            _check_total(self.ref, self.field, self.nbytes, "resolution x frame rate x duration")
