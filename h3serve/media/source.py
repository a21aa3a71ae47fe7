"""Latent-mask editing sources: a source video (MP4/MOV) and a source audio (WAV/MP3), up to 512 MiB each.

Unlike references, a source has no duration limits: it is decoded only as far as the output needs. The video
goes to 24 fps (frames held), is *stretched* to the canvas, and is trimmed or padded with its last frame to the
output's frame count; audio (a file, or the source video's soundtrack) becomes stereo 32 kHz, cut at the output's
duration (the pipeline pads a shorter one).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Iterator

import av
import numpy as np
from av.audio.resampler import AudioResampler
from PIL import Image

from h3serve.media.media_checks import reason
from h3serve.media.media_inputs import MediaDecodeError, MediaError, MediaFormatError, MediaLimitError
from h3serve.media.pixel_budget import DecodedPixels, video_header
from h3serve.media.sniff import Kind, identify, read_head
from h3serve.rules import limits
from h3serve.rules.request import MediaRef

_CONTAINERS = {"mp4": "mov", "wav": "wav", "mp3": "mp3"}
ACCEPTED = {"video": "MP4/MOV (H.264/H.265)", "audio": "WAV or MP3"}


def check_source(ref: MediaRef, field: str, kind: Kind) -> None:
    """Kind (from the bytes) and size, without decoding: what a request is checked for before it is queued (a
    video's frame size too, from its header: `check_source_header`)."""
    try:
        size = os.stat(ref.path).st_size
        fmt = identify(read_head(ref.path))
    except OSError as exc:
        raise MediaDecodeError(ref.name, field, f"cannot read the file ({exc.strerror})", "a readable file") from None
    if fmt is None or fmt.kind != kind or fmt.name not in _CONTAINERS:
        found = "not a recognised media file" if fmt is None else f"a {fmt.kind} file ({fmt.label})"
        raise MediaFormatError(ref.name, field, f"expected a source {kind}, got {found}", ACCEPTED[kind])
    if size > limits.MAX_SOURCE_BYTES:
        raise MediaLimitError(
            ref.name, field, f"file is {size:,} bytes", f"sources at most {limits.MAX_SOURCE_BYTES // 2**20} MiB"
        )


def check_source_header(ref: MediaRef, field: str, kind: Kind) -> None:
    """`check_source`, and a video's frame size within the pixel budget from its header (nothing decoded). A source
    streams each frame onto the canvas, so only the frame size is bounded, not the frame count."""
    check_source(ref, field, kind)
    if kind == "video":
        video_header(ref, field, _CONTAINERS["mp4"], total=False)


def _open(ref: MediaRef, field: str, kind: Kind) -> av.container.InputContainer:
    check_source_header(ref, field, kind)
    fmt = identify(read_head(ref.path))
    return av.open(str(ref.path), format=_CONTAINERS[fmt.name])


def _decode_error(ref: MediaRef, field: str, what: str, exc: Exception) -> MediaDecodeError:
    return MediaDecodeError(ref.name, field, f"cannot decode the {what} ({reason(exc, ref)})", "a complete, valid file")


def _read_audio(container: av.container.InputContainer, max_seconds: float) -> np.ndarray | None:
    """The first audio stream as stereo 32 kHz float32 (2, N), at most `max_seconds` long; None if there is none."""
    if not container.streams.audio:
        return None
    resampler = AudioResampler(format="fltp", layout="stereo", rate=limits.AUDIO_SAMPLE_RATE)
    wanted = math.ceil(max_seconds * limits.AUDIO_SAMPLE_RATE)
    chunks, have = [], 0
    for frame in container.decode(container.streams.audio[0]):
        for out in resampler.resample(frame):
            chunks.append(out.to_ndarray())
            have += chunks[-1].shape[1]
        if have >= wanted:
            break
    else:
        for out in resampler.resample(None):
            chunks.append(out.to_ndarray())
    if not chunks:
        return None
    return np.ascontiguousarray(np.concatenate(chunks, axis=1)[:, :wanted], dtype=np.float32)


def load_source_audio(ref: MediaRef, field: str, max_seconds: float) -> np.ndarray:
    """A source audio file -> (2, N) float32 at 32 kHz, at most `max_seconds`."""
    try:
        with _open(ref, field, "audio") as container:
            samples = _read_audio(container, max_seconds)
    except MediaError:
        raise
    except Exception as exc:
        raise _decode_error(ref, field, "audio", exc) from None
    if samples is None:
        raise MediaDecodeError(ref.name, field, "the file has no decodable audio", ACCEPTED["audio"])
    return samples


def _video_stream(container, ref: MediaRef, field: str):
    """The container's first video stream and its frame rate (> 0); refused, naming the field, without either."""
    if not container.streams.video:
        raise MediaFormatError(ref.name, field, "the file has no video stream", ACCEPTED["video"])
    stream = container.streams.video[0]
    rate = stream.average_rate or stream.guessed_rate
    if not rate or rate <= 0:
        raise MediaFormatError(ref.name, field, "the video has no frame rate", "a known, positive frame rate")
    return stream, float(rate)


def on_24fps_grid(
    frames: Iterable[av.VideoFrame], rate: float, num_frames: int
) -> Iterator[tuple[int, int, int, av.VideoFrame]]:
    """(index, start, end, frame) for each decoded frame of a `rate` fps video: the output frames [start, end) it
    fills on the 24 fps grid (held at a lower rate, none when skipped at a higher one); stops once frame
    `num_frames - 1` is filled."""
    scale = limits.FPS / rate
    for index, frame in enumerate(frames):
        start = math.floor(index * scale + 0.5)
        end = min(math.floor((index + 1) * scale + 0.5), num_frames)
        yield index, start, end, frame
        if end >= num_frames:
            return


def load_source_video(
    ref: MediaRef, field: str, num_frames: int, width: int, height: int, with_audio: bool
) -> tuple[np.ndarray, np.ndarray | None]:
    """Source frames (num_frames, height, width, 3) uint8 and (if asked) its soundtrack (2, N) or None."""
    try:
        with _open(ref, field, "video") as container:
            stream, rate = _video_stream(container, ref, field)
            out = np.empty((num_frames, height, width, 3), dtype=np.uint8)
            filled = 0
            budget = DecodedPixels(ref, field, total=False)
            for _, start, end, frame in on_24fps_grid(container.decode(stream), rate, num_frames):
                budget.add(frame)
                if end > start:
                    image = frame.to_image().convert("RGB")
                    if image.size != (width, height):
                        image = image.resize((width, height), Image.Resampling.LANCZOS)  # stretched to the canvas
                    out[start:end] = np.asarray(image)
                    filled = end
        if filled == 0:
            raise MediaDecodeError(ref.name, field, "the file has no decodable video frames", "a complete, valid file")
        out[filled:] = out[filled - 1]  # a shorter source holds its last frame
        audio = None
        if with_audio:
            with _open(ref, field, "video") as container:
                audio = _read_audio(container, num_frames / limits.FPS)
    except MediaError:
        raise
    except Exception as exc:
        raise _decode_error(ref, field, "video", exc) from None
    return out, audio


def frames_at_24fps(ref: MediaRef, field: str) -> int:
    """How many 24 fps frames a source video holds (frames held as in `load_source_video`), by decoding it."""
    try:
        with _open(ref, field, "video") as container:
            stream, rate = _video_stream(container, ref, field)
            budget = DecodedPixels(ref, field, total=False)
            count = 0
            for frame in container.decode(stream):
                budget.add(frame)
                count += 1
    except MediaError:
        raise
    except Exception as exc:
        raise _decode_error(ref, field, "video", exc) from None
    return math.floor(count * limits.FPS / rate + 0.5)
