"""What a probe of an MP4 found (`h3serve.media.output_probe`): the result type both readers fill."""

from __future__ import annotations

from dataclasses import dataclass

NO_STREAMS = "no video or audio stream (truncated, or not a media file?)"
FFPROBE_READER = "ffprobe"  # the ffprobe/ffmpeg binaries on PATH
PYAV_READER = "pyav"  # PyAV's bundled libav (no binaries)


@dataclass(frozen=True)
class ProbeResult:
    """What a reader found in a file; fields are None where a stream or value is missing.

    ``nb_frames`` and ``audio_duration`` come from decoding, not from the header.
    ``error`` is set when the file cannot be opened or parsed at all.
    ``reader`` is what `probe` read it with: FFPROBE_READER or PYAV_READER.
    """

    path: str
    error: str | None = None
    video_codec: str | None = None
    pix_fmt: str | None = None
    width: int | None = None
    height: int | None = None
    r_frame_rate: str | None = None
    nb_frames: int | None = None
    audio_codec: str | None = None
    audio_profile: str | None = None
    sample_rate: int | None = None
    channels: int | None = None
    audio_samples: int | None = None
    audio_duration: float | None = None
    duration: float | None = None
    decode_errors: tuple[str, ...] = ()
    reader: str | None = None
