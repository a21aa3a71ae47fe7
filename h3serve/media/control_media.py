"""A ControlNet request's media: the control video, the inpainting source and its mask, as decoded frames.

Videos go onto the 24 fps grid as the edit sources do (frame i of an r fps file fills the output frames from
round(i·24/r): frames held at a lower rate, skipped at a higher one), are cut at the output's frame count and hold
their last frame when shorter; they keep their own size (the rank resizes them bilinearly to the canvas). A mask
may be a still image (one frame, for every output frame) or a gray video. At most `MAX_CONTROL_FRAMES` source frames
are decoded.
"""

from __future__ import annotations

import av
import numpy as np
from PIL import Image, UnidentifiedImageError

from h3serve.media.media_inputs import MediaDecodeError, MediaError, MediaFormatError, MediaLimitError
from h3serve.media.source import check_source, on_24fps_grid
from h3serve.rules import limits
from h3serve.rules.request import MediaRef

MAX_CONTROL_FRAMES = 3600  # decoded source frames per control input (vLLM-Omni's bound)


def read_control_frames(ref: MediaRef, field: str, num_frames: int, gray: bool = False) -> np.ndarray:
    """uint8 frames [T, h, w, C] (C = 1 gray, 3 RGB): T = `num_frames`, or 1 for a still mask image."""
    if gray:
        try:
            with Image.open(ref.path) as image:
                return np.asarray(image.convert("L"))[None, :, :, None].copy()
        except (UnidentifiedImageError, OSError):
            pass  # not an image: a mask video
    check_source(ref, field, "video")
    try:
        with av.open(str(ref.path)) as container:
            if not container.streams.video:
                raise MediaFormatError(ref.name, field, "the file has no video stream", "a video file")
            stream = container.streams.video[0]
            rate = float(stream.average_rate or stream.guessed_rate or limits.FPS)
            out: np.ndarray | None = None
            filled = 0
            for index, start, end, frame in on_24fps_grid(container.decode(stream), rate, num_frames):
                if index >= MAX_CONTROL_FRAMES:
                    raise MediaLimitError(ref.name, field, f"more than {MAX_CONTROL_FRAMES} frames decoded",
                                          f"at most {MAX_CONTROL_FRAMES} frames before the output's end")
                pixels = frame.to_ndarray(format="gray" if gray else "rgb24")
                pixels = pixels[:, :, None] if gray else pixels
                if out is None:
                    out = np.empty((num_frames, *pixels.shape), dtype=np.uint8)
                elif pixels.shape != out.shape[1:]:
                    raise MediaFormatError(ref.name, field, "the frames change size", "frames of one size")
                if end > start:
                    out[start:end] = pixels
                    filled = end
    except MediaError:
        raise
    except Exception as exc:
        raise MediaDecodeError(ref.name, field, f"cannot decode the video ({exc})", "a complete, valid file") from None
    if out is None or filled == 0:
        raise MediaDecodeError(ref.name, field, "the file has no decodable video frames", "a complete, valid file")
    out[filled:] = out[filled - 1]
    return out
