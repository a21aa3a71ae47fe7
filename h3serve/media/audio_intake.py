"""Audio clips: WAV (PCM) or MP3, decoded with PyAV to float32 planar at the file's own rate, and the resampler to
the model's rate; also the soundtrack collector the video decoder shares."""

from __future__ import annotations

import math
from dataclasses import dataclass

import av
import numpy as np
from av.audio.resampler import AudioResampler

from h3serve.media.media_checks import ACCEPTED, check_clip_duration, inspect_file, reason, too_long
from h3serve.media.media_errors import MediaDecodeError, MediaError, MediaFormatError
from h3serve.rules import limits
from h3serve.rules.request import MediaRef

_AUDIO_CONTAINERS = {"wav": "wav", "mp3": "mp3"}


@dataclass(frozen=True, eq=False)
class AudioMedia:
    name: str
    samples: np.ndarray  # (C, N) float32 in [-1, 1], C in {1, 2}, at the file's own rate
    sample_rate: int

    @property
    def duration_s(self) -> float:
        return self.samples.shape[1] / self.sample_rate


def codec_name(stream: av.stream.Stream) -> str:
    try:
        return stream.codec_context.codec.canonical_name
    except Exception:
        return "unknown"


class AudioCollector:
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


def max_clip_samples(rate: float) -> int:
    """One sample past the longest accepted clip: reaching it means the clip is too long."""
    return math.floor((limits.MEDIA_CLIP_MAX_S + limits.MEDIA_DURATION_SLACK_S) * rate) + 1


def load_audio(ref: MediaRef, field: str = "audio") -> AudioMedia:
    """Decode a WAV (PCM) or MP3 clip of 2-15 s to float32 planar at its own sample rate."""
    fmt = inspect_file(ref, field, "audio")
    if fmt.name not in _AUDIO_CONTAINERS:
        raise MediaFormatError(ref.name, field, f"unsupported audio format {fmt.label}", ACCEPTED["audio"])
    try:
        with av.open(str(ref.path), format=_AUDIO_CONTAINERS[fmt.name]) as container:
            if not container.streams.audio:
                raise MediaDecodeError(ref.name, field, "the file has no audio stream", ACCEPTED["audio"])
            stream = container.streams.audio[0]
            codec = codec_name(stream)
            if not (codec.startswith("pcm_") if fmt.name == "wav" else codec == "mp3"):
                raise MediaFormatError(
                    ref.name, field, f"unsupported audio codec {codec} in {fmt.label}", ACCEPTED["audio"]
                )
            collector = AudioCollector(stream, max_clip_samples(int(stream.codec_context.sample_rate or 1)))
            for frame in container.decode(stream):
                collector.add(frame)
                if collector.full:
                    raise too_long(ref, field, "audio")
            samples = collector.samples()
    except MediaError:
        raise
    except Exception as exc:
        raise MediaDecodeError(
            ref.name, field, f"cannot decode the {fmt.label} audio ({reason(exc, ref)})", "a complete, valid file"
        ) from None
    if samples is None:
        raise MediaDecodeError(ref.name, field, "the file has no decodable audio", "a complete, valid file")
    audio = AudioMedia(name=ref.name, samples=samples, sample_rate=collector.rate)
    if collector.full:
        raise too_long(ref, field, "audio")
    check_clip_duration(ref, field, "audio", audio.duration_s)
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
