"""The PyAV reader behind `h3serve.media.output_probe`, for machines without the ffprobe/ffmpeg binaries.

It reads the same fields as the ffprobe reader, with PyAV's bundled libav: the stream parameters from the
header, the frame and sample counts and the decode errors from one full decode. A decode error is what
``ffmpeg -v error`` would print: a libav log line at error level or worse (captured with ``av.logging``), or
an exception from demuxing or decoding; like ffmpeg, the decode goes on past a bad packet.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import av
import av.logging

from h3serve.media.probe_result import NO_STREAMS, PYAV_READER, ProbeResult

_OWN = "h3serve"  # the log name under which an exception is recorded among the captured libav lines


@contextmanager
def _libav_errors() -> Iterator[list[tuple[int, str, str]]]:
    """Capture libav's log lines from every thread (decoder threads log too) while the block runs.

    PyAV drops libav's logs by default and folds a line repeating the previous one; both settings are
    process-wide, so they are changed for the block and restored after it.
    """
    level, skip = av.logging.get_level(), av.logging.get_skip_repeated()
    if level is None or level < av.logging.ERROR:
        av.logging.set_level(av.logging.ERROR)
    av.logging.set_skip_repeated(False)
    try:
        with av.logging.Capture(local=False) as logs:
            yield logs
    finally:
        av.logging.set_skip_repeated(skip)
        av.logging.set_level(level)


def _error_lines(logs: list[tuple[int, str, str]]) -> tuple[str, ...]:
    lines = []
    for level, name, message in logs:
        text = message.strip()
        if level <= av.logging.ERROR and text:
            lines.append(text if name in ("", _OWN) else f"[{name}] {text}")
    return tuple(lines)


def _reason(error: Exception) -> str:
    return getattr(error, "strerror", None) or str(error)


def _decode(container, streams: list, logs: list[tuple[int, str, str]]) -> dict[int, int]:
    """Decode ``streams`` in full; per stream index, the video frames or audio samples decoded.

    A demux error ends the decode, a decode error skips the packet; either is added to ``logs``.
    """
    counts = dict.fromkeys((s.index for s in streams), 0)
    packets = container.demux(*streams)
    while True:
        try:
            packet = next(packets)
        except StopIteration:
            break
        except av.FFmpegError as e:
            logs.append((av.logging.ERROR, _OWN, f"error reading the file: {_reason(e)}"))
            break
        try:
            frames = packet.decode()
        except av.FFmpegError as e:
            logs.append((av.logging.ERROR, _OWN, f"error while decoding stream #0:{packet.stream.index}: {_reason(e)}"))
            continue
        for frame in frames:
            counts[packet.stream.index] += frame.samples if isinstance(frame, av.AudioFrame) else 1
    return counts


def _streams(container) -> tuple:
    video = next((s for s in container.streams if s.type == "video"), None)
    audio = next((s for s in container.streams if s.type == "audio"), None)
    return video, audio


def decode_errors(path: str) -> tuple[str, ...]:
    """Fully decode ``path``'s first video and audio streams; the error lines (empty if clean)."""
    with _libav_errors() as logs:
        try:
            with av.open(path) as container:
                streams = [s for s in _streams(container) if s is not None]
                if streams:
                    _decode(container, streams, logs)
        except (av.FFmpegError, OSError) as e:
            logs.append((av.logging.ERROR, _OWN, f"PyAV cannot read the file: {_reason(e)}"))
    return _error_lines(logs)


def _video_fields(video) -> dict:
    if video is None:
        return {}
    fmt, rate = video.codec_context.format, video.base_rate
    return dict(
        video_codec=video.codec_context.codec.canonical_name,
        pix_fmt=fmt.name if fmt is not None else None,
        width=video.codec_context.width,
        height=video.codec_context.height,
        r_frame_rate=f"{rate.numerator}/{rate.denominator}" if rate is not None else "0/0",
    )


def _audio_fields(audio) -> dict:
    if audio is None:
        return {}
    return dict(
        audio_codec=audio.codec_context.codec.canonical_name,
        audio_profile=audio.profile,
        sample_rate=audio.codec_context.sample_rate,
        channels=audio.codec_context.channels,
    )


def probe(path: str) -> ProbeResult:
    """``h3serve.media.output_probe.probe`` read with PyAV; ``path`` is a regular file. Never raises for a bad file."""
    with _libav_errors() as logs:
        try:
            container = av.open(path)
        except (av.FFmpegError, OSError) as e:
            said = _error_lines(logs)
            return ProbeResult(
                path, error=f"PyAV cannot read the file: {said[0] if said else _reason(e)}", reader=PYAV_READER
            )
        with container:  # the streams are read inside it: they are freed with the container
            video, audio = _streams(container)
            if video is None and audio is None:
                return ProbeResult(path, error=NO_STREAMS, reader=PYAV_READER)
            fields = {**_video_fields(video), **_audio_fields(audio)}  # the header's, before decoding
            counts = _decode(container, [s for s in (video, audio) if s is not None], logs)
            if video is not None:
                fields["nb_frames"] = counts[video.index]
            if audio is not None:
                samples, rate = counts[audio.index], fields["sample_rate"]
                fields.update(audio_samples=samples, audio_duration=samples / rate if rate else None)
            duration = container.duration / av.time_base if container.duration is not None else None
    return ProbeResult(path, **fields, duration=duration, decode_errors=_error_lines(logs), reader=PYAV_READER)
