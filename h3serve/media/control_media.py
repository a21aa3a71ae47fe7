"""A ControlNet request's media: the control video, the inpainting source and its mask, checked at intake and
decoded frame by frame onto the 24 fps grid.

Videos go onto the 24 fps grid as the edit sources do (frame i of an r fps file fills the output frames from
round(i·24/r): frames held at a lower rate, skipped at a higher one) and stop at the output's frame count; the
consumer holds the last frame when they are shorter and resizes each frame to the canvas as it arrives (the rank:
h3serve.rank.media_conditioning), so nothing is ever held at the source's size beyond the frame being decoded. A
mask may be a still image (one frame, for every output frame) or a gray video. At most `MAX_CONTROL_FRAMES` source
frames are decoded, each within the pixel budget (h3serve.media.pixel_budget), which intake applies from the
headers before the job is queued (`check_control_media`).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import av
import numpy as np
from PIL import Image

from h3serve.media.media_checks import reason
from h3serve.media.media_errors import MediaDecodeError, MediaError, MediaFormatError, MediaLimitError
from h3serve.media.pixel_budget import DecodedPixels, image_header, video_header
from h3serve.media.sniff import identify, read_head
from h3serve.media.source import check_source, on_24fps_grid
from h3serve.rules import limits
from h3serve.rules.request import ControlRequest, MediaRef

MAX_CONTROL_FRAMES = 3600  # decoded source frames per control input (vLLM-Omni's bound)
CONTROL_PARTS = ("control", "source", "mask")
_MASK_ACCEPTED = "a mask image (PNG, JPEG, WEBP) or a gray MP4/MOV video"


def control_field(control: ControlRequest, part: str) -> str:
    """How errors name a control input: the request's `extra_params.<type>.<part>_path`."""
    return f"extra_params.{control.type}.{part}_path"


@dataclass(frozen=True)
class GridFrame:
    """One decoded frame and the output frames [start, end) it fills (a still mask: all of them)."""

    start: int
    end: int
    pixels: np.ndarray  # [h, w, C] uint8, C = 1 (gray) or 3 (RGB), at the source's size
    still: bool = False


def _is_image(ref: MediaRef, field: str) -> bool:
    try:
        fmt = identify(read_head(ref.path))
    except OSError as exc:
        raise MediaDecodeError(ref.name, field, f"cannot read the file ({exc.strerror or 'I/O error'})",
                               "a readable file") from None
    if fmt is None:
        raise MediaFormatError(ref.name, field, "not a recognised image or video file", _MASK_ACCEPTED)
    return fmt.kind == "image"


def check_control_file(ref: MediaRef, field: str, gray: bool) -> None:
    """Intake: a control input's kind (from its bytes), byte size and header within the pixel budget."""
    if gray and _is_image(ref, field):
        image_header(ref, field)
        return
    check_source(ref, field, "video")
    video_header(ref, field, max_frames=MAX_CONTROL_FRAMES)


def check_control_media(control: ControlRequest) -> None:
    """Intake: every input of a control request, nothing decoded beyond the headers (`MediaError` naming it)."""
    for part in CONTROL_PARTS:
        ref = getattr(control, part)
        if ref is not None:
            check_control_file(ref, control_field(control, part), gray=part == "mask")


def control_frames(ref: MediaRef, field: str, num_frames: int, gray: bool = False) -> Iterator[GridFrame]:
    """The frames of a control input on the 24 fps grid, up to frame `num_frames - 1`, one at a time; a mask image
    is one still frame. `MediaError` (naming `field`) for anything wrong with the file, never another error."""
    try:
        if gray and _is_image(ref, field):
            yield _still_mask(ref, field, num_frames)
            return
        yield from _video_frames(ref, field, num_frames, gray)
    except MediaError:
        raise
    except Exception as exc:
        raise MediaDecodeError(ref.name, field, f"cannot decode the file ({reason(exc, ref)})",
                               "a complete, valid file") from None


def _still_mask(ref: MediaRef, field: str, num_frames: int) -> GridFrame:
    image_header(ref, field)  # the size from the header first: PIL decodes whatever it is asked to
    with Image.open(ref.path) as image:
        pixels = np.array(image.convert("L"))[:, :, None]  # writable: torch takes it as is
    return GridFrame(0, num_frames, pixels, still=True)


def _video_frames(ref: MediaRef, field: str, num_frames: int, gray: bool) -> Iterator[GridFrame]:
    check_source(ref, field, "video")
    video_header(ref, field, max_frames=MAX_CONTROL_FRAMES)
    budget = DecodedPixels(ref, field)
    shape: tuple[int, int] | None = None
    with av.open(str(ref.path)) as container:
        stream = container.streams.video[0]
        rate = float(stream.average_rate or stream.guessed_rate or limits.FPS)
        for index, start, end, frame in on_24fps_grid(container.decode(stream), rate, num_frames):
            if index >= MAX_CONTROL_FRAMES:
                raise MediaLimitError(ref.name, field, f"more than {MAX_CONTROL_FRAMES} frames decoded",
                                      f"at most {MAX_CONTROL_FRAMES} frames before the output's end")
            budget.add(frame)
            if shape is None:
                shape = (frame.height, frame.width)
            elif (frame.height, frame.width) != shape:
                raise MediaFormatError(ref.name, field, "the frames change size", "frames of one size")
            if end > start:
                pixels = frame.to_ndarray(format="gray" if gray else "rgb24")
                yield GridFrame(start, end, pixels[:, :, None] if gray else pixels)
