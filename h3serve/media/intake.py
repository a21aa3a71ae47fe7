"""One media intake for the CLI and the server: FL2VA keyframes and Ref2VA references, files in, arrays out.

The type of a file comes from its bytes (`h3serve.media.sniff`), never from its name; a declared `MediaRef.kind`
that contradicts the bytes is an error. Every check that needs no decoding (type, byte size, counts) runs before
any pixel or sample is decoded, and durations are measured by decoding (frames / fps, samples / rate). Every
violation raises a `MediaError` subclass naming the file, the field and the limit; no PIL or PyAV exception
escapes.

Decoding follows diffusers' `MiniMaxH3*Reference.from_file`: PIL with EXIF orientation then `convert("RGB")`
for images; PyAV for video (rgb24 frames, fps from the stream's average rate) and audio (float32 planar at the
native rate). Deliberate differences: a video's display rotation is applied the way the ffmpeg CLI shows it
(diffusers rotates 90/270-degree videos the opposite way), a soundtrack with more than two channels is downmixed to
stereo (diffusers would reject it later), and a soundtrack is cut at the clip limit.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import av
import numpy as np
from av.audio.resampler import AudioResampler
from PIL import Image, ImageOps

from h3serve import limits
from h3serve.errors import ClientError
from h3serve.media.sniff import Format, Kind, identify, read_head, sniff
from h3serve.request import MediaRef

__all__ = [
    "MAX_BYTES",
    "AudioMedia",
    "ImageMedia",
    "Media",
    "MediaDecodeError",
    "MediaError",
    "MediaFormatError",
    "MediaLimitError",
    "ReferenceSetError",
    "VideoMedia",
    "load_audio",
    "load_image",
    "load_media",
    "load_references",
    "load_video",
    "resample_audio",
    "sniff",
]

_IMAGE_FORMATS = {"jpeg": "JPEG", "png": "PNG", "webp": "WEBP", "heif": "HEIF"}  # sniffed name -> PIL format
_VIDEO_CONTAINERS = {"mp4": "mov", "matroska": "matroska", "mpegts": "mpegts"}  # sniffed name -> FFmpeg demuxer
_AUDIO_CONTAINERS = {"wav": "wav", "mp3": "mp3"}
_VIDEO_CODECS = {"h264": "H.264", "hevc": "H.265"}
_SOUNDTRACK_CODECS = {"aac": "AAC", "mp3": "MP3"}
# Per-file byte limit by kind (the server applies it while storing uploads and downloads, too).
MAX_BYTES: dict[Kind, int] = {
    "image": limits.MAX_IMAGE_BYTES, "video": limits.MAX_VIDEO_BYTES, "audio": limits.MAX_AUDIO_BYTES
}

ACCEPTED = {
    "image": "images JPEG, PNG, WEBP or HEIC/HEIF",
    "video": "videos H.264 or H.265 (MP4/MOV, MKV or MPEG-TS) with AAC, MP3 or no sound",
    "audio": "audio WAV (PCM) or MP3",
}
ACCEPTED_ANY = "; ".join(ACCEPTED.values())


# --------------------------------------------------------------------------------------------------------------------
# Errors and results


def _one_line(text: str, max_chars: int = 160) -> str:
    text = "".join(c if c.isprintable() else "?" for c in str(text))
    return text if len(text) <= max_chars else text[: max_chars - 3] + "..."


class MediaError(ClientError, ValueError):
    """An input file breaks a rule. `str(err)` is one line: "field ('file'): what is wrong; limit: the rule"."""

    code = "invalid_media"

    def __init__(self, file: str, field: str, message: str, limit: str):
        self.file = _one_line(file)
        self.field = field
        self.message = _one_line(message, 240)
        self.limit = limit
        super().__init__(f"{field} ({self.file!r}): {self.message}; limit: {limit}")


class MediaFormatError(MediaError):
    """Unknown bytes, an unsupported format, container or codec, or bytes that contradict the declared kind."""


class MediaDecodeError(MediaError):
    """The file is unreadable, corrupt or truncated."""


class MediaLimitError(MediaError):
    """A per-file limit: byte size, edges, aspect ratio, duration, decoded size."""


class ReferenceSetError(MediaError):
    """A limit on the Ref2VA reference set: counts per kind and in total, total durations, audio pairing."""


@dataclass(frozen=True, eq=False)
class ImageMedia:
    name: str
    image: Image.Image  # RGB, EXIF orientation applied


@dataclass(frozen=True, eq=False)
class AudioMedia:
    name: str
    samples: np.ndarray  # (C, N) float32 in [-1, 1], C in {1, 2}, at the file's own rate
    sample_rate: int

    @property
    def duration_s(self) -> float:
        return self.samples.shape[1] / self.sample_rate


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


Media = ImageMedia | VideoMedia | AudioMedia


# --------------------------------------------------------------------------------------------------------------------
# Checks that need no decoding


def _inspect(ref: MediaRef, field: str, expected: Kind | None) -> Format:
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


def _check_aspect(ref: MediaRef, field: str, what: str, width: int, height: int) -> None:
    a, b = limits.MEDIA_MAX_ASPECT
    if width <= 0 or height <= 0 or max(width, height) * b > min(width, height) * a:
        raise MediaLimitError(
            ref.name,
            field,
            f"{what} is {width}x{height} px",
            f"aspect ratio (width:height) between {a}:{b} and {b}:{a}",
        )


def _check_image_size(ref: MediaRef, field: str, width: int, height: int) -> None:
    lo, hi = limits.MEDIA_IMAGE_MIN_EDGE, limits.MEDIA_IMAGE_MAX_EDGE
    if not (lo <= width <= hi and lo <= height <= hi):
        raise MediaLimitError(ref.name, field, f"image is {width}x{height} px", f"both image edges {lo}-{hi} px")
    _check_aspect(ref, field, "image", width, height)


def _clip_limit() -> str:
    return f"each clip {limits.MEDIA_CLIP_MIN_S:g}-{limits.MEDIA_CLIP_MAX_S:g} s"


def _check_clip_duration(ref: MediaRef, field: str, what: str, seconds: float) -> None:
    slack = limits.MEDIA_DURATION_SLACK_S
    if not limits.MEDIA_CLIP_MIN_S - slack <= seconds <= limits.MEDIA_CLIP_MAX_S + slack:
        raise MediaLimitError(ref.name, field, f"{what} is {seconds:.2f} s long", _clip_limit())


def _too_long(ref: MediaRef, field: str, what: str) -> MediaLimitError:
    """Raised while decoding: decoding stops as soon as a clip passes the limit, so its full length is unknown."""
    return MediaLimitError(ref.name, field, f"{what} is longer than {limits.MEDIA_CLIP_MAX_S:g} s", _clip_limit())


def _reason(exc: Exception, ref: MediaRef) -> str:
    """A short, single-line cause that never shows the server-side path."""
    text = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
    return _one_line(str(text).replace(str(ref.path), ref.name), 120)


# --------------------------------------------------------------------------------------------------------------------
# Images


@functools.cache
def _register_heif() -> None:
    import pillow_heif

    pillow_heif.register_heif_opener()


def load_image(ref: MediaRef, field: str = "image") -> ImageMedia:
    """Decode a JPEG/PNG/WEBP/HEIC/HEIF image to RGB with its EXIF orientation applied."""
    fmt = _inspect(ref, field, "image")
    if fmt.name not in _IMAGE_FORMATS:
        raise MediaFormatError(ref.name, field, f"unsupported image format {fmt.label}", ACCEPTED["image"])
    try:
        if fmt.name == "heif":
            _register_heif()
        with Image.open(ref.path, formats=[_IMAGE_FORMATS[fmt.name]]) as img:
            # The header's size is checked before any pixel is decoded: refuses decompression bombs cheaply. The
            # limits are symmetric in width and height, so the orientation applied below cannot change the outcome.
            _check_image_size(ref, field, *img.size)
            img.load()
            try:
                upright = ImageOps.exif_transpose(img)
            except Exception:  # a broken EXIF block does not make the pixels unusable
                upright = img
            image = upright.convert("RGB")
    except MediaError:
        raise
    except Image.DecompressionBombError:
        raise MediaLimitError(
            ref.name,
            field,
            "image has too many pixels",
            f"both image edges {limits.MEDIA_IMAGE_MIN_EDGE}-{limits.MEDIA_IMAGE_MAX_EDGE} px",
        ) from None
    except ImportError:
        raise MediaFormatError(
            ref.name, field, "HEIC/HEIF support (pillow-heif) is not installed", ACCEPTED["image"]
        ) from None
    except Exception as exc:
        raise MediaDecodeError(
            ref.name, field, f"cannot decode the {fmt.label} image ({_reason(exc, ref)})", "a complete, valid file"
        ) from None
    return ImageMedia(name=ref.name, image=image)


# --------------------------------------------------------------------------------------------------------------------
# Audio


def _codec(stream: av.stream.Stream) -> str:
    try:
        return stream.codec_context.codec.canonical_name
    except Exception:
        return "unknown"


class _AudioCollector:
    """Decoded audio frames -> (C, N) float32 planar at the stream's own rate; more than 2 channels -> stereo."""

    def __init__(self, stream: av.audio.stream.AudioStream, max_samples: int):
        self.rate = int(stream.codec_context.sample_rate)
        if self.rate <= 0:
            raise ValueError("no sample rate")
        layout = "mono" if stream.codec_context.channels == 1 else "stereo"
        self.resampler = AudioResampler(format="fltp", layout=layout, rate=self.rate)
        self.max_samples = max_samples
        self.chunks: list[np.ndarray] = []
        self.count = 0

    @property
    def full(self) -> bool:
        return self.count >= self.max_samples

    def add(self, frame: av.AudioFrame | None) -> None:
        for out in self.resampler.resample(frame):
            chunk = out.to_ndarray()
            self.chunks.append(chunk)
            self.count += chunk.shape[1]

    def samples(self) -> np.ndarray | None:
        self.add(None)  # flush
        if not self.count:
            return None
        samples = np.concatenate(self.chunks, axis=1)[:, : self.max_samples]
        return np.clip(samples, -1.0, 1.0, out=samples).astype(np.float32, copy=False)


def _max_clip_samples(rate: float) -> int:
    """One sample past the longest accepted clip: reaching it means the clip is too long."""
    return math.floor((limits.MEDIA_CLIP_MAX_S + limits.MEDIA_DURATION_SLACK_S) * rate) + 1


def load_audio(ref: MediaRef, field: str = "audio") -> AudioMedia:
    """Decode a WAV (PCM) or MP3 clip of 2-15 s to float32 planar at its own sample rate."""
    fmt = _inspect(ref, field, "audio")
    if fmt.name not in _AUDIO_CONTAINERS:
        raise MediaFormatError(ref.name, field, f"unsupported audio format {fmt.label}", ACCEPTED["audio"])
    try:
        with av.open(str(ref.path), format=_AUDIO_CONTAINERS[fmt.name]) as container:
            if not container.streams.audio:
                raise MediaDecodeError(ref.name, field, "the file has no audio stream", ACCEPTED["audio"])
            stream = container.streams.audio[0]
            codec = _codec(stream)
            if not (codec.startswith("pcm_") if fmt.name == "wav" else codec == "mp3"):
                raise MediaFormatError(
                    ref.name, field, f"unsupported audio codec {codec} in {fmt.label}", ACCEPTED["audio"]
                )
            collector = _AudioCollector(stream, _max_clip_samples(int(stream.codec_context.sample_rate or 1)))
            for frame in container.decode(stream):
                collector.add(frame)
                if collector.full:
                    raise _too_long(ref, field, "audio")
            samples = collector.samples()
    except MediaError:
        raise
    except Exception as exc:
        raise MediaDecodeError(
            ref.name, field, f"cannot decode the {fmt.label} audio ({_reason(exc, ref)})", "a complete, valid file"
        ) from None
    if samples is None:
        raise MediaDecodeError(ref.name, field, "the file has no decodable audio", "a complete, valid file")
    audio = AudioMedia(name=ref.name, samples=samples, sample_rate=collector.rate)
    if collector.full:
        raise _too_long(ref, field, "audio")
    _check_clip_duration(ref, field, "audio", audio.duration_s)
    return audio


def resample_audio(samples: np.ndarray, rate: int, target: int = limits.AUDIO_SAMPLE_RATE) -> np.ndarray:
    """Resample (C, N) float32 audio (C in {1, 2}) from `rate` to `target` Hz with FFmpeg's swresample (via PyAV).

    The output has exactly ceil(N * target / rate) samples, the length `torchaudio.transforms.Resample` returns
    (swresample itself yields round(N * target / rate); the at most one missing sample is zero-padded). Output
    sample k is aligned with input time k / target: the resampler's delay is flushed, not prepended.
    """
    samples = np.asarray(samples, dtype=np.float32)
    if samples.ndim != 2 or samples.shape[0] not in (1, 2):
        raise ValueError(f"expected (channels, samples) audio with 1 or 2 channels, got shape {samples.shape}")
    length = -(-samples.shape[1] * target // rate)
    if rate == target or samples.shape[1] == 0:
        return samples.copy()
    layout = "mono" if samples.shape[0] == 1 else "stereo"
    frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(samples), format="fltp", layout=layout)
    frame.sample_rate = rate
    resampler = AudioResampler(format="fltp", layout=layout, rate=target)
    chunks = [out.to_ndarray() for out in resampler.resample(frame)]
    chunks += [out.to_ndarray() for out in resampler.resample(None)]
    out = np.concatenate(chunks, axis=1)[:, :length] if chunks else np.zeros((samples.shape[0], 0), np.float32)
    if out.shape[1] < length:
        out = np.pad(out, ((0, 0), (0, length - out.shape[1])))
    return np.ascontiguousarray(out, dtype=np.float32)


# --------------------------------------------------------------------------------------------------------------------
# Video


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

    def __init__(self, ref: MediaRef, field: str, keep: bool = True, reduce: ReduceVideo | None = None,
                 fps: float | None = None):
        self.ref, self.field, self.keep = ref, field, keep
        self.reduce, self.fps = (reduce, fps) if keep and fps is not None else (None, None)
        self.reducer: FrameReducer | None = None
        self.frames: list[np.ndarray] = []
        self.count = 0
        self.shape: tuple[int, ...] | None = None
        self.nbytes = 0
        self.first_pts: float | None = None
        self.last_pts: float | None = None

    def add(self, frame: av.VideoFrame) -> None:
        # The display matrix rotates the picture counterclockwise by `frame.rotation` degrees for display, which is
        # what the ffmpeg CLI applies (checked against it in the tests). diffusers' `from_file` turns the other way.
        turns = round(frame.rotation / 90.0) % 4
        rgb = frame.to_ndarray(format="rgb24")
        if turns:
            rgb = np.rot90(rgb, k=turns)
        if self.shape is None:
            _check_aspect(self.ref, self.field, "video", rgb.shape[1], rgb.shape[0])
            self.shape = rgb.shape
            if self.reduce is not None:
                self.reducer = self.reduce(self.fps, rgb.shape[1], rgb.shape[0])
        elif rgb.shape != self.shape:
            raise MediaFormatError(
                self.ref.name, self.field, "the frame size changes within the video", "a constant frame size"
            )
        self.nbytes += rgb.nbytes
        if self.nbytes > limits.MEDIA_VIDEO_MAX_DECODED_BYTES:
            raise MediaLimitError(
                self.ref.name,
                self.field,
                "the video decodes to too many pixels (resolution x frame rate x duration)",
                f"at most {limits.MEDIA_VIDEO_MAX_DECODED_BYTES / 2**30:g} GiB of decoded RGB frames",
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
    ref: MediaRef, field: str = "video", keep_frames: bool = True, reduce: ReduceVideo | None = None,
    start_s: float = 0.0,
) -> VideoMedia:
    """Decode an H.264/H.265 clip of 2-15 s to rgb24 frames, with its AAC/MP3 soundtrack if it has one.

    `keep_frames=False` checks every rule (decoding every frame) without keeping the frames (see `_FrameStore`).
    `reduce` (used when the container states a frame rate) keeps only what it makes of the frames as they are
    decoded; the result's `frames` are then the reducer's and `fps` is still the source's. `start_s` trims the
    clip (frames and soundtrack) before that time; the duration rules apply to what remains.
    """
    fmt = _inspect(ref, field, "video")
    if fmt.name not in _VIDEO_CONTAINERS:
        raise MediaFormatError(ref.name, field, f"unsupported video container {fmt.label}", ACCEPTED["video"])
    try:
        with av.open(str(ref.path), format=_VIDEO_CONTAINERS[fmt.name]) as container:
            return _decode_video(container, ref, field, keep_frames, reduce, start_s)
    except MediaError:
        raise
    except Exception as exc:
        raise MediaDecodeError(
            ref.name, field, f"cannot decode the {fmt.label} video ({_reason(exc, ref)})", "a complete, valid file"
        ) from None


def _decode_video(
    container: av.container.InputContainer, ref: MediaRef, field: str, keep_frames: bool, reduce: ReduceVideo | None,
    start_s: float = 0.0,
) -> VideoMedia:
    if not container.streams.video:
        raise MediaFormatError(ref.name, field, "the file has no video stream", ACCEPTED["video"])
    video = container.streams.video[0]
    if (codec := _codec(video)) not in _VIDEO_CODECS:
        raise MediaFormatError(ref.name, field, f"unsupported video codec {codec}", ACCEPTED["video"])
    sound = container.streams.audio[0] if container.streams.audio else None
    if sound is not None and (codec := _codec(sound)) not in _SOUNDTRACK_CODECS:
        raise MediaFormatError(ref.name, field, f"unsupported sound codec {codec} in the video", ACCEPTED["video"])

    video.thread_type = "AUTO"
    fps = _average_fps(video)
    max_frames = None if fps is None else _max_clip_samples(fps)  # same rule as audio, counted in frames
    store = _FrameStore(ref, field, keep_frames, reduce, fps)
    soundtrack = None
    if sound is not None:
        soundtrack = _AudioCollector(sound, _max_clip_samples(int(sound.codec_context.sample_rate or 1)) - 1)
    audio_start: float | None = None  # time of the first soundtrack frame kept
    skipped = 0
    for packet in container.demux(*[s for s in (video, sound) if s is not None]):
        if packet.stream is sound and soundtrack.full:
            continue  # a soundtrack is kept up to the clip limit; the pipeline cuts it to the generated length anyway
        for frame in packet.decode():
            if isinstance(frame, av.VideoFrame):
                if start_s and frame.time is not None and frame.time < start_s - 1e-6:
                    skipped += 1  # trimmed by start_time_seconds
                    continue
                store.add(frame)
                if max_frames is not None and store.count >= max_frames:
                    raise _too_long(ref, field, "video")
            else:
                end = None if frame.time is None else frame.time + frame.samples / (frame.sample_rate or 1)
                if start_s and end is not None and end <= start_s:
                    continue
                audio_start = frame.time if audio_start is None else audio_start
                soundtrack.add(frame)

    if store.count == 0 and skipped:
        raise MediaLimitError(
            ref.name, field, f"start_time_seconds {start_s:g} is outside the source duration",
            "a start inside the video, with at least 2 s after it",
        )
    if store.count == 0:
        raise MediaDecodeError(ref.name, field, "the file has no decodable video frames", "a complete, valid file")
    fps = fps or store.fps_from_timestamps()
    if fps is None:
        raise MediaFormatError(ref.name, field, "the video has no frame rate", "a known, positive frame rate")
    _check_clip_duration(ref, field, "video", store.count / fps)
    samples = None if soundtrack is None else soundtrack.samples()
    if samples is not None and start_s and audio_start is not None and start_s > audio_start:
        samples = samples[:, round((start_s - audio_start) * soundtrack.rate) :]  # cut from the same offset
    audio = None if samples is None else AudioMedia(name=ref.name, samples=samples, sample_rate=soundtrack.rate)
    return VideoMedia(name=ref.name, frames=store.stack(), fps=fps, audio=audio, reduced=store.reducer is not None,
                      source_frames=store.count)


# --------------------------------------------------------------------------------------------------------------------
# Dispatch and the Ref2VA reference set


_LOADERS = {"image": load_image, "video": load_video, "audio": load_audio}


def load_media(ref: MediaRef, field: str) -> Media:
    """Decode any accepted file, choosing the loader from its bytes; `ref.kind`, if set, must agree with them."""
    return _LOADERS[_inspect(ref, field, None).kind](ref, field)


def check_references(refs: Sequence[MediaRef], start_times: Sequence[float] = ()) -> None:
    """Apply every rule of `load_references` without keeping decoded video frames (for request validation:
    a server checks each request's media before queueing it, and must not hold GiBs of frames to do so)."""
    load_references(refs, keep_frames=False, start_times=start_times)


def load_references(
    refs: Sequence[MediaRef], keep_frames: bool = True, reduce_video: ReduceVideo | None = None,
    start_times: Sequence[float] = (),
) -> list[Media]:
    """Decode a Ref2VA reference set, in order, with the set rules applied (fields "references[i]").

    Rules: at most 9 images, 3 videos, 3 audio clips and 12 files; audio needs at least one image or video;
    video clips and audio clips each last 2-15 s and at most 15 s together per modality (a video's soundtrack is
    part of the video and counts towards neither audio limit). Counts, types and byte sizes are checked for the
    whole set before anything is decoded. `start_times` trims the video references: one value for all, or one
    per video reference in order (ref2va `start_time_seconds`); the duration rules apply to what remains.
    """
    fields = [f"references[{i}]" for i in range(len(refs))]
    if len(refs) > limits.MAX_MEDIA_FILES:
        i = limits.MAX_MEDIA_FILES
        raise ReferenceSetError(
            refs[i].name, fields[i], f"{len(refs)} reference files", f"at most {limits.MAX_MEDIA_FILES} files"
        )
    kinds = [_inspect(ref, field, None).kind for ref, field in zip(refs, fields, strict=True)]
    caps = {"image": limits.REF_MAX_IMAGES, "video": limits.REF_MAX_VIDEOS, "audio": limits.REF_MAX_AUDIOS}
    for i, kind in enumerate(kinds):
        if (count := kinds[: i + 1].count(kind)) > caps[kind]:
            raise ReferenceSetError(
                refs[i].name, fields[i], f"{kind} reference number {count}", f"at most {caps[kind]} {kind} references"
            )
    if kinds and set(kinds) == {"audio"}:
        raise ReferenceSetError(
            refs[0].name, fields[0], "only audio references", "audio references need at least one image or video"
        )

    videos = kinds.count("video")
    if len(start_times) > 1 and len(start_times) != videos:
        raise ReferenceSetError(
            refs[0].name, "start_time_seconds", f"{len(start_times)} start times for {videos} video references",
            "one start time, or one per video reference",
        )
    starts = iter(list(start_times) * videos if len(start_times) == 1 else start_times)
    media: list[Media] = []
    totals = {"video": 0.0, "audio": 0.0}
    for ref, field, kind in zip(refs, fields, kinds, strict=True):
        if kind == "video":
            item = load_video(ref, field, keep_frames, reduce_video, next(starts, 0.0))
        else:
            item = _LOADERS[kind](ref, field)
        if isinstance(item, VideoMedia | AudioMedia):
            totals[kind] += item.duration_s
            if totals[kind] > limits.REF_TOTAL_MAX_S + limits.MEDIA_DURATION_SLACK_S:
                raise ReferenceSetError(
                    ref.name,
                    field,
                    f"{kind} references add up to {totals[kind]:.2f} s",
                    f"at most {limits.REF_TOTAL_MAX_S:g} s of {kind} references in total",
                )
        media.append(item)
    return media
