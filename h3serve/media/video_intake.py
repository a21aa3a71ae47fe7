"""Video clips: H.264 or H.265 in MP4/MOV, MKV or MPEG-TS, with an AAC or MP3 soundtrack or none, decoded with
PyAV to upright rgb24 frames; a `ReduceVideo` may keep only what its consumer needs as the frames arrive."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import av
import numpy as np

from h3serve.media.audio_intake import AudioCollector, AudioMedia, codec_name, max_clip_samples
from h3serve.media.media_checks import ACCEPTED, check_aspect, check_clip_duration, inspect_file, reason, too_long
from h3serve.media.media_errors import MediaDecodeError, MediaError, MediaFormatError, MediaLimitError
from h3serve.media.pixel_budget import DecodedPixels, video_header
from h3serve.rules.request import MediaRef

_VIDEO_CONTAINERS = {"mp4": "mov", "matroska": "matroska", "mpegts": "mpegts"}  # sniffed name -> FFmpeg demuxer
_VIDEO_CODECS = {"h264": "H.264", "hevc": "H.265"}
_SOUNDTRACK_CODECS = {"aac": "AAC", "mp3": "MP3"}


@dataclass(frozen=True, eq=False)
class VideoMedia:
    name: str
    frames: np.ndarray  # (T, H, W, 3) uint8, upright (display rotation applied)
    fps: float
    audio: AudioMedia | None  # the soundtrack, if the file has one
    reduced: bool = False  # `frames` are what a `ReduceVideo` kept, not the source frames
    source_frames: int = 0  # frames decoded from the file (0: as many as `frames` holds)

    @property
    def duration_s(self) -> float:
        return (self.source_frames or self.frames.shape[0]) / self.fps


def _average_fps(stream: av.video.stream.VideoStream) -> float | None:
    for rate in (stream.average_rate, stream.guessed_rate):
        if rate is not None and math.isfinite(float(rate)) and float(rate) > 0:
            return float(rate)
    return None


class FrameReducer(Protocol):
    """Takes a clip's frames one at a time as they are decoded and keeps only what its consumer needs (e.g. the
    model's frame rate and canvas), so a clip is never held at its source resolution."""

    def add(self, index: int, rgb: np.ndarray) -> None: ...
    def result(self) -> np.ndarray: ...


# (fps, width, height of the upright frames) -> the reducer for one clip
ReduceVideo = Callable[[float, int, int], FrameReducer]


class _FrameStore:
    """Decoded frames, upright, with the aspect and decoded-size guards applied as they arrive."""

    def __init__(
        self, ref: MediaRef, field: str, keep: bool = True, reduce: ReduceVideo | None = None, fps: float | None = None
    ):
        self.ref, self.field, self.keep = ref, field, keep
        self.reduce, self.fps = (reduce, fps) if keep and fps is not None else (None, None)
        self.reducer: FrameReducer | None = None
        self.frames: list[np.ndarray] = []
        self.count = 0
        self.shape: tuple[int, ...] | None = None
        self.budget = DecodedPixels(ref, field)
        self.first_pts: float | None = None
        self.last_pts: float | None = None

    def add(self, frame: av.VideoFrame) -> None:
        # The display matrix rotates the picture counterclockwise by `frame.rotation` degrees for display, which is
        # what the ffmpeg CLI applies (checked against it in the tests). diffusers' `from_file` turns the other way.
        turns = round(frame.rotation / 90.0) % 4
        self.budget.add(frame)  # before the frame becomes an array
        rgb = frame.to_ndarray(format="rgb24")
        if turns:
            rgb = np.rot90(rgb, k=turns)
        if self.shape is None:
            check_aspect(self.ref, self.field, "video", rgb.shape[1], rgb.shape[0])
            self.shape = rgb.shape
            if self.reduce is not None:
                self.reducer = self.reduce(self.fps, rgb.shape[1], rgb.shape[0])
        elif rgb.shape != self.shape:
            raise MediaFormatError(
                self.ref.name, self.field, "the frame size changes within the video", "a constant frame size"
            )
        if frame.time is not None:
            self.first_pts = frame.time if self.first_pts is None else self.first_pts
            self.last_pts = frame.time
        if self.reducer is not None:
            self.reducer.add(self.count, rgb)
        elif self.keep:
            self.frames.append(rgb)
        self.count += 1

    def fps_from_timestamps(self) -> float | None:
        if self.count > 1 and self.first_pts is not None and self.last_pts > self.first_pts:
            return (self.count - 1) / (self.last_pts - self.first_pts)
        return None

    def stack(self) -> np.ndarray:
        """One (T, H, W, 3) array, filled frame by frame so that peak memory stays near one copy.

        Without `keep` (a check, not a load) it is a zero-strided read-only view of the right shape: no memory.
        """
        if not self.keep:
            return np.broadcast_to(np.zeros(3, dtype=np.uint8), (self.count, *self.shape))
        if self.reducer is not None:
            return self.reducer.result()
        out = np.empty((len(self.frames), *self.frames[0].shape), dtype=np.uint8)
        for i in range(len(self.frames)):
            out[i] = self.frames[i]
            self.frames[i] = None  # type: ignore[call-overload]
        self.frames = []
        return out


def load_video(
    ref: MediaRef,
    field: str = "video",
    keep_frames: bool = True,
    reduce: ReduceVideo | None = None,
    start_s: float = 0.0,
) -> VideoMedia:
    """Decode an H.264/H.265 clip of 2-15 s to rgb24 frames, with its AAC/MP3 soundtrack if it has one.

    `keep_frames=False` checks every rule (decoding every frame) without keeping the frames (see `_FrameStore`).
    `reduce` (used when the container states a frame rate) keeps only what it makes of the frames as they are
    decoded; the result's `frames` are then the reducer's and `fps` is still the source's. `start_s` trims the
    clip (frames and soundtrack) before that time; the duration rules apply to what remains.
    """
    fmt = inspect_file(ref, field, "video")
    if fmt.name not in _VIDEO_CONTAINERS:
        raise MediaFormatError(ref.name, field, f"unsupported video container {fmt.label}", ACCEPTED["video"])
    video_header(ref, field, _VIDEO_CONTAINERS[fmt.name])  # the frame size, before a frame is decoded
    try:
        with av.open(str(ref.path), format=_VIDEO_CONTAINERS[fmt.name]) as container:
            return _decode_video(container, ref, field, keep_frames, reduce, start_s)
    except MediaError:
        raise
    except Exception as exc:
        raise MediaDecodeError(
            ref.name, field, f"cannot decode the {fmt.label} video ({reason(exc, ref)})", "a complete, valid file"
        ) from None


def _demux(
    container: av.container.InputContainer,
    streams: tuple[av.stream.Stream, ...],
    store: _FrameStore,
    soundtrack: AudioCollector | None,
    max_frames: int | None,
    start_s: float,
) -> tuple[float | None, int]:
    """Decode the video stream into `store` and the soundtrack, if any, into `soundtrack`, both from `start_s` on;
    (the time of the first soundtrack frame kept, the video frames skipped before `start_s`)."""
    audio_start: float | None = None
    skipped = 0
    for packet in container.demux(*streams):
        if packet.stream is not streams[0] and soundtrack.full:
            continue  # a soundtrack is kept up to the clip limit; the pipeline cuts it to the generated length anyway
        for frame in packet.decode():
            if isinstance(frame, av.VideoFrame):
                if start_s and frame.time is not None and frame.time < start_s - 1e-6:
                    skipped += 1  # trimmed by start_time_seconds
                    continue
                store.add(frame)
                if max_frames is not None and store.count >= max_frames:
                    raise too_long(store.ref, store.field, "video")
            else:
                end = None if frame.time is None else frame.time + frame.samples / (frame.sample_rate or 1)
                if start_s and end is not None and end <= start_s:
                    continue
                audio_start = frame.time if audio_start is None else audio_start
                soundtrack.add(frame)
    return audio_start, skipped


def _decode_video(
    container: av.container.InputContainer,
    ref: MediaRef,
    field: str,
    keep_frames: bool,
    reduce: ReduceVideo | None,
    start_s: float = 0.0,
) -> VideoMedia:
    if not container.streams.video:
        raise MediaFormatError(ref.name, field, "the file has no video stream", ACCEPTED["video"])
    video = container.streams.video[0]
    if (codec := codec_name(video)) not in _VIDEO_CODECS:
        raise MediaFormatError(ref.name, field, f"unsupported video codec {codec}", ACCEPTED["video"])
    sound = container.streams.audio[0] if container.streams.audio else None
    if sound is not None and (codec := codec_name(sound)) not in _SOUNDTRACK_CODECS:
        raise MediaFormatError(ref.name, field, f"unsupported sound codec {codec} in the video", ACCEPTED["video"])

    video.thread_type = "AUTO"
    fps = _average_fps(video)
    max_frames = None if fps is None else max_clip_samples(fps)  # same rule as audio, counted in frames
    store = _FrameStore(ref, field, keep_frames, reduce, fps)
    soundtrack = None
    if sound is not None:
        soundtrack = AudioCollector(sound, max_clip_samples(int(sound.codec_context.sample_rate or 1)) - 1)
    streams = (video, sound) if sound is not None else (video,)
    audio_start, skipped = _demux(container, streams, store, soundtrack, max_frames, start_s)
    if store.count == 0 and skipped:
        raise MediaLimitError(
            ref.name,
            field,
            f"start_time_seconds {start_s:g} is outside the source duration",
            "a start inside the video, with at least 2 s after it",
        )
    if store.count == 0:
        raise MediaDecodeError(ref.name, field, "the file has no decodable video frames", "a complete, valid file")
    fps = fps or store.fps_from_timestamps()
    if fps is None:
        raise MediaFormatError(ref.name, field, "the video has no frame rate", "a known, positive frame rate")
    check_clip_duration(ref, field, "video", store.count / fps)
    samples = None if soundtrack is None else soundtrack.samples()
    if samples is not None and start_s and audio_start is not None and start_s > audio_start:
        samples = samples[:, round((start_s - audio_start) * soundtrack.rate) :]  # cut from the same offset
    audio = None if samples is None else AudioMedia(name=ref.name, samples=samples, sample_rate=soundtrack.rate)
    return VideoMedia(
        name=ref.name,
        frames=store.stack(),
        fps=fps,
        audio=audio,
        reduced=store.reducer is not None,
        source_frames=store.count,
    )
