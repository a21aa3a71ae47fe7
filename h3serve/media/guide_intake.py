"""Timeline guides' files (h3serve/rules/guides.py): measured before a request is queued (`probe_guides`, no pixel
kept), decoded for the pipeline when it runs (`load_guide_picture`, `load_guide_sound`).

Guides have their own limits (a server's `GuideLimits`), not the references': no minimum edge, clip length or sound
length; a bound on the pixels of one picture (checked from the header, before any pixel is decoded), on the bytes of
each file and of all of them, and on the decoding work of all of them together (rules/guides.py).

Decoding, as vLLM-Omni's: images EXIF-oriented; clips upright, on the 24 fps grid (frames held or skipped by their
index at the stream's rate), the first G frames kept; pictures center-cropped to the canvas' aspect and scaled with
Lanczos (PIL's `ImageOps.fit`); sounds to stereo 32 kHz (mono duplicated, more channels downmixed), a soundtrack of a
clip never read.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass

import av
import numpy as np
from PIL import Image, ImageOps

from h3serve.errors import RequestError
from h3serve.media.audio_intake import AudioCollector, resample_audio
from h3serve.media.image_intake import IMAGE_FORMATS, register_heif
from h3serve.media.media_checks import reason
from h3serve.media.media_errors import MediaDecodeError, MediaError, MediaFormatError, MediaLimitError
from h3serve.media.sniff import Format, identify, read_head
from h3serve.media.source import on_24fps_grid
from h3serve.rules import limits
from h3serve.rules.guide_limits import GuideLimits
from h3serve.rules.guides import GuideProbe, PlacedGuide, entry_field
from h3serve.rules.request import MediaRef, TimelineGuide

# Sniffed format -> the FFmpeg demuxer, per kind (vLLM-Omni: JPEG/PNG/WebP, MP4/MOV, WAV/MP3/FLAC).
_CONTAINERS = {
    "video": {"mp4": "mov", "matroska": "matroska"},
    "audio": {"wav": "wav", "mp3": "mp3", "flac": "flac"},
}
_SAMPLES_PER_LATENT = limits.AUDIO_SAMPLE_RATE // limits.AUDIO_LATENTS_PER_SECOND  # 800
_UNBOUNDED = 2**62  # decoding at run time: the request's sounds were measured against the limits when planned
ACCEPTED = {
    "image": "images JPEG, PNG, WEBP or HEIC/HEIF",
    "video": "videos MP4/MOV or MKV",
    "audio": "audio WAV, MP3 or FLAC",
}


def _format(ref: MediaRef, field: str) -> Format:
    """The file's format from its bytes; it must be of the kind its entry declares, in a format guides take."""
    try:
        fmt = identify(read_head(ref.path))
    except OSError as exc:
        raise MediaDecodeError(ref.name, field, f"cannot read the file ({exc.strerror})", "a readable file") from None
    kind = ref.kind or "image"
    if fmt is None or fmt.kind != kind:
        found = "not a recognised media file" if fmt is None else f"a {fmt.kind} file ({fmt.label})"
        article = "an" if kind == "image" or kind == "audio" else "a"
        raise MediaFormatError(ref.name, field, f"declared as {article} {kind} guide, but the file is {found}",
                               ACCEPTED[kind])
    if fmt.name not in (IMAGE_FORMATS if kind == "image" else _CONTAINERS[kind]):
        raise MediaFormatError(ref.name, field, f"unsupported {kind} format {fmt.label}", ACCEPTED[kind])
    return fmt


@dataclass
class _Files:
    """The distinct files of a request's guides: a reused file counts once for bytes."""

    guide_limits: GuideLimits
    sizes: dict[str, int]

    def add(self, ref: MediaRef, field: str) -> None:
        try:
            key = os.path.realpath(ref.path)
            size = os.stat(ref.path).st_size
        except OSError as exc:
            reason_ = f"cannot read the file ({exc.strerror})"
            raise MediaDecodeError(ref.name, field, reason_, "a readable file") from None
        if key in self.sizes:
            return
        limit = self.guide_limits.max_bytes(ref.kind or "image")
        if size > limit:
            raise MediaLimitError(ref.name, field, f"file is {size:,} bytes", f"{ref.kind} guides at most "
                                                                              f"{limit / 2**20:g} MiB")
        self.sizes[key] = size
        if len(self.sizes) > self.guide_limits.max_unique_files:
            raise MediaLimitError(ref.name, field, f"{len(self.sizes)} distinct guide files",
                                  f"at most {self.guide_limits.max_unique_files} per request")
        total = sum(self.sizes.values())
        if total > self.guide_limits.max_total_upload_bytes:
            raise MediaLimitError(ref.name, field, f"the guide files add up to {total:,} bytes",
                                  f"at most {self.guide_limits.max_total_upload_bytes / 2**20:g} MiB together")


def probe_guides(guides: Sequence[TimelineGuide], guide_limits: GuideLimits) -> tuple[GuideProbe, ...]:
    """What each guide's files hold (frames, pixels, samples), decoding as little as it can and keeping nothing;
    `MediaError` naming the entry's source on a file that breaks a rule."""
    if len(guides) > guide_limits.max_entries:  # before any file is read
        raise RequestError(entry_field(guide_limits.max_entries),
                           f"{len(guides)} guides; this server takes at most {guide_limits.max_entries}")
    files = _Files(guide_limits, {})
    probes = []
    for i, guide in enumerate(guides):
        visual_frames = source_frames = source_pixels = samples = latents = 0
        if guide.visual is not None:
            field = entry_field(i, guide.visual.kind or "image")
            files.add(guide.visual, field)
            probe = _probe_image if guide.visual.kind == "image" else _probe_clip
            visual_frames, source_frames, source_pixels = probe(guide.visual, field, guide_limits)
        if guide.audio is not None:
            field = entry_field(i, "audio")
            files.add(guide.audio, field)
            samples, latents = _probe_sound(guide.audio, field, guide_limits)
        probes.append(GuideProbe(visual_frames, source_frames, source_pixels, samples, latents))
    return tuple(probes)


def _check_pixels(ref: MediaRef, field: str, width: int, height: int, guide_limits: GuideLimits) -> int:
    pixels = width * height
    if pixels <= 0 or pixels > guide_limits.max_source_pixels:
        raise MediaLimitError(ref.name, field, f"the picture is {width}x{height} px",
                              f"at most {guide_limits.max_source_pixels:,} pixels")
    return pixels


def _probe_image(ref: MediaRef, field: str, guide_limits: GuideLimits) -> tuple[int, int, int]:
    fmt = _format(ref, field)
    try:
        if fmt.name == "heif":
            register_heif()
        with Image.open(ref.path, formats=[IMAGE_FORMATS[fmt.name]]) as img:
            return 1, 1, _check_pixels(ref, field, *img.size, guide_limits)  # from the header: no pixel decoded
    except MediaError:
        raise
    except Exception as exc:
        raise MediaDecodeError(ref.name, field, f"cannot read the {fmt.label} image ({reason(exc, ref)})",
                               "a complete, valid file") from None


def _probe_clip(ref: MediaRef, field: str, guide_limits: GuideLimits) -> tuple[int, int, int]:
    """(24 fps frames, source frames, pixels of a frame), decoding every frame (the count is measured, never read
    from the container) and stopping once the frames alone pass the decoding limit."""
    fmt = _format(ref, field)
    try:
        with av.open(str(ref.path), format=_CONTAINERS["video"][fmt.name]) as container:
            stream, rate = _video_stream(container, ref, field)
            pixels = _check_pixels(ref, field, stream.codec_context.width, stream.codec_context.height, guide_limits)
            count = 0
            for _ in container.decode(stream):
                count += 1
                if count * pixels > guide_limits.max_decoded_visual_pixels:
                    raise MediaLimitError(ref.name, field, "the clip decodes to more pixels than the limit",
                                          f"at most {guide_limits.max_decoded_visual_pixels:,} decoded pixels")
    except MediaError:
        raise
    except Exception as exc:
        raise MediaDecodeError(ref.name, field, f"cannot decode the {fmt.label} video ({reason(exc, ref)})",
                               "a complete, valid file") from None
    if count == 0:
        raise MediaDecodeError(ref.name, field, "the file has no decodable video frames", "a complete, valid file")
    return max(1, math.floor(count * limits.FPS / rate + 0.5)), count, pixels


def _probe_sound(ref: MediaRef, field: str, guide_limits: GuideLimits) -> tuple[int, int]:
    """(samples per channel at the source rate, audio latents at 32 kHz), decoding the whole sound."""
    samples, rate = _decode_sound(ref, field, guide_limits.max_decoded_audio_samples)
    resampled = -(-samples.shape[1] * limits.AUDIO_SAMPLE_RATE // rate)  # resample_audio's length
    return samples.shape[1], -(-resampled // _SAMPLES_PER_LATENT)


def _video_stream(container: av.container.InputContainer, ref: MediaRef, field: str) -> tuple[av.VideoStream, float]:
    if not container.streams.video:
        raise MediaFormatError(ref.name, field, "the file has no video stream", ACCEPTED["video"])
    stream = container.streams.video[0]
    rate = stream.average_rate or stream.guessed_rate
    if not rate or float(rate) <= 0:
        raise MediaFormatError(ref.name, field, "the video has no frame rate", "a known, positive frame rate")
    return stream, float(rate)


def _decode_sound(ref: MediaRef, field: str, max_samples: int) -> tuple[np.ndarray, int]:
    """The sound (C, N) float32 at its own rate (C 1 or 2, more channels downmixed) and that rate; refused past
    `max_samples` per channel, or empty."""
    fmt = _format(ref, field)
    try:
        with av.open(str(ref.path), format=_CONTAINERS["audio"][fmt.name]) as container:
            if not container.streams.audio:
                raise MediaDecodeError(ref.name, field, "the file has no audio stream", ACCEPTED["audio"])
            stream = container.streams.audio[0]
            collector = AudioCollector(stream, max_samples + 1)
            for frame in container.decode(stream):
                collector.add(frame)
                if collector.full:
                    raise MediaLimitError(ref.name, field, "the sound is longer than the limit",
                                          f"at most {max_samples:,} samples per channel")
            samples = collector.samples()
    except MediaError:
        raise
    except Exception as exc:
        raise MediaDecodeError(ref.name, field, f"cannot decode the {fmt.label} audio ({reason(exc, ref)})",
                               "a complete, valid file") from None
    if samples is None or samples.shape[1] == 0:
        raise MediaDecodeError(ref.name, field, "the sound is empty", "a non-empty sound")
    return samples, collector.rate


# ---------------------------------------------------------------------------------------------------------------
# Decoding for the pipeline (rank side)
# ---------------------------------------------------------------------------------------------------------------


def fit_to_canvas(image: Image.Image, width: int, height: int) -> np.ndarray:
    """A picture center-cropped to the canvas' aspect and scaled to it with Lanczos: uint8 [height, width, 3]."""
    if image.size == (width, height):
        return np.array(image.convert("RGB"))
    return np.array(ImageOps.fit(image.convert("RGB"), (width, height), Image.Resampling.LANCZOS))


def load_guide_picture(guide: PlacedGuide, field: str, width: int, height: int) -> np.ndarray:
    """The guide's picture as its G frames on the canvas, uint8 [G, height, width, 3]."""
    ref = guide.visual
    if ref is None:
        raise ValueError("this guide has no picture")
    fmt = _format(ref, field)
    try:
        if ref.kind == "image":
            if fmt.name == "heif":
                register_heif()
            with Image.open(ref.path, formats=[IMAGE_FORMATS[fmt.name]]) as img:
                img.load()
                try:
                    upright = ImageOps.exif_transpose(img)
                except Exception:  # a broken EXIF block does not make the pixels unusable
                    upright = img
                return fit_to_canvas(upright, width, height)[None]
        return _clip_frames(ref, field, fmt, guide.frames, width, height)
    except MediaError:
        raise
    except Exception as exc:
        raise MediaDecodeError(ref.name, field, f"cannot decode the {fmt.label} guide ({reason(exc, ref)})",
                               "a complete, valid file") from None


def _clip_frames(ref: MediaRef, field: str, fmt: Format, frames: int, width: int, height: int) -> np.ndarray:
    out = np.empty((frames, height, width, 3), dtype=np.uint8)
    filled = 0
    with av.open(str(ref.path), format=_CONTAINERS["video"][fmt.name]) as container:
        stream, rate = _video_stream(container, ref, field)
        for _, start, end, frame in on_24fps_grid(container.decode(stream), rate, frames):
            if end > start:
                rgb = frame.to_ndarray(format="rgb24")
                turns = round(frame.rotation / 90.0) % 4  # upright, as the ffmpeg CLI shows it (video_intake)
                rgb = np.rot90(rgb, k=turns) if turns else rgb
                out[start:end] = fit_to_canvas(Image.fromarray(np.ascontiguousarray(rgb)), width, height)
                filled = end
    if filled < frames:
        raise MediaDecodeError(ref.name, field, f"the clip decoded to {filled} frames, {frames} were measured",
                               "a file that decodes the same way twice")
    return out


def load_guide_sound(guide: PlacedGuide, field: str) -> np.ndarray:
    """The guide's sound as stereo 32 kHz float32 (2, N), whole: it is encoded whole and its latents cropped after
    (a cut waveform would change the encoder's last latents). Its length was checked when the request was planned."""
    if guide.audio is None:
        raise ValueError("this guide has no sound")
    samples, rate = _decode_sound(guide.audio, field, _UNBOUNDED)
    if samples.shape[0] == 1:
        samples = np.repeat(samples, 2, axis=0)  # mono duplicated (swresample's upmix would scale it by 1/sqrt 2)
    return resample_audio(samples, rate, limits.AUDIO_SAMPLE_RATE)
