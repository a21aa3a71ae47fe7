"""Inspect an output MP4 and check it against the H3 output contract.

The file is read with the system ffprobe/ffmpeg when both are on PATH (a reader independent of the PyAV that
wrote it), else with PyAV's bundled libav (`h3serve.media.probe_pyav`); `ProbeResult.reader` says which.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

from h3serve.media import probe_pyav
from h3serve.media.aac_packets import AAC_FRAME_SAMPLES
from h3serve.media.probe_result import FFPROBE_READER, NO_STREAMS, PYAV_READER, ProbeResult
from h3serve.media.raw import PathLike

__all__ = ["ProbeResult", "check_output_contract", "decode_errors", "probe", "summary_line"]

CONTRACT_FPS = "24/1"
CONTRACT_FPS_VALUE = 24
CONTRACT_SAMPLE_RATE = 32000
CONTRACT_CHANNELS = 2
_TIMEOUT_S = 300.0


def _binaries() -> tuple[str, str] | None:
    """The paths of ffprobe and ffmpeg when both are on PATH, else None (PyAV reads the file)."""
    ffprobe, ffmpeg = shutil.which("ffprobe"), shutil.which("ffmpeg")
    return (ffprobe, ffmpeg) if ffprobe is not None and ffmpeg is not None else None


def _run(args: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, errors="replace", timeout=_TIMEOUT_S, check=False)


def _first_line(text: str, default: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[0] if lines else default


def _int(value: object) -> int | None:
    try:
        return int(str(value))
    except ValueError:
        return None


def _float(value: object) -> float | None:
    try:
        return float(str(value))
    except ValueError:
        return None


def decode_errors(path: PathLike) -> tuple[str, ...]:
    """Fully decode ``path``; return the error lines (empty if clean).

    With ``ffmpeg -v error -f null`` when ffprobe/ffmpeg are installed, else with PyAV. ffmpeg exits 0 even for
    a truncated file ("partial file", "Invalid data"), so stderr is what counts.
    """
    binaries = _binaries()
    if binaries is None:
        return probe_pyav.decode_errors(str(path))
    return _ffmpeg_decode_errors(binaries[1], str(path))


def _ffmpeg_decode_errors(ffmpeg: str, path: str) -> tuple[str, ...]:
    try:
        proc = _run([ffmpeg, "-nostdin", "-hide_banner", "-v", "error", "-i", str(path), "-f", "null", "-"])
    except subprocess.TimeoutExpired:
        return (f"ffmpeg decode timed out after {_TIMEOUT_S:.0f} s",)
    errors = [ln.strip() for ln in proc.stderr.splitlines() if ln.strip()]
    if proc.returncode != 0:
        errors.append(f"ffmpeg exited with status {proc.returncode}")
    return tuple(errors)


def probe(path: PathLike) -> ProbeResult:
    """Probe ``path``: stream parameters from the header, frame/sample counts by decoding, a full decode check.

    Read with ffprobe/ffmpeg when both are on PATH, else with PyAV (``reader`` says which). Never raises for a
    missing, unreadable or corrupt file: ``error`` (or ``decode_errors``) says what is wrong.
    """
    p = str(path)
    binaries = _binaries()
    reader = PYAV_READER if binaries is None else FFPROBE_READER
    if not Path(p).is_file():
        return ProbeResult(p, error="file not found" if not Path(p).exists() else "not a regular file", reader=reader)
    if binaries is None:
        return probe_pyav.probe(p)
    return _ffprobe(p, *binaries)


def _ffprobe(p: str, ffprobe: str, ffmpeg: str) -> ProbeResult:
    reader = FFPROBE_READER
    cmd = [ffprobe, "-v", "error", "-show_format", "-show_streams"]
    cmd += ["-show_entries", "frame=media_type,nb_samples", "-of", "json", p]
    try:
        proc = _run(cmd)
    except subprocess.TimeoutExpired:
        return ProbeResult(p, error=f"ffprobe timed out after {_TIMEOUT_S:.0f} s", reader=reader)
    try:
        info = json.loads(proc.stdout) if proc.stdout.strip() else {}
    except json.JSONDecodeError:
        info = {}
    if proc.returncode != 0 or "format" not in info:
        return ProbeResult(
            p, error=f"ffprobe cannot read the file: {_first_line(proc.stderr, 'no output')}", reader=reader
        )

    streams = info.get("streams", [])
    video = next((s for s in streams if s.get("codec_type") == "video"), None)
    audio = next((s for s in streams if s.get("codec_type") == "audio"), None)
    if video is None and audio is None:
        return ProbeResult(p, error=NO_STREAMS, reader=reader)
    frames = info.get("frames", [])
    n_video = sum(1 for f in frames if f.get("media_type") == "video")
    n_samples = sum(_int(f.get("nb_samples")) or 0 for f in frames if f.get("media_type") == "audio")
    sample_rate = _int(audio.get("sample_rate")) if audio else None

    return ProbeResult(
        path=p,
        video_codec=video.get("codec_name") if video else None,
        pix_fmt=video.get("pix_fmt") if video else None,
        width=_int(video.get("width")) if video else None,
        height=_int(video.get("height")) if video else None,
        r_frame_rate=video.get("r_frame_rate") if video else None,
        nb_frames=n_video if video else None,
        audio_codec=audio.get("codec_name") if audio else None,
        audio_profile=audio.get("profile") if audio else None,
        sample_rate=sample_rate,
        channels=_int(audio.get("channels")) if audio else None,
        audio_samples=n_samples if audio else None,
        audio_duration=n_samples / sample_rate if audio and sample_rate else None,
        duration=_float(info["format"].get("duration")),
        decode_errors=_ffmpeg_decode_errors(ffmpeg, p),
        reader=reader,
    )


def check_output_contract(result: ProbeResult) -> list[str]:
    """Every way ``result`` violates the output contract; an empty list means the file is OK.

    Contract: H.264 yuv420p at 24/1 fps with 17n+5 frames (n >= 1); AAC-LC, 32000 Hz, stereo, lasting
    frames/24 s to within 1/24 s + one AAC frame; and a full decode without errors.
    """
    if result.error is not None:
        return [f"unreadable: {result.error}"]
    v: list[str] = []
    if result.video_codec is None:
        v.append("no video stream")
    else:
        if result.video_codec != "h264":
            v.append(f"video codec is {result.video_codec}, expected h264")
        if result.pix_fmt != "yuv420p":
            v.append(f"pix_fmt is {result.pix_fmt}, expected yuv420p")
        if result.r_frame_rate != CONTRACT_FPS:
            v.append(f"r_frame_rate is {result.r_frame_rate}, expected {CONTRACT_FPS}")
        n = result.nb_frames or 0
        if n < 22 or (n - 5) % 17:
            v.append(f"{n} video frames decoded, expected 17n+5 with n >= 1 (22, 39, ..., 107, 124, ...)")
    if result.audio_codec is None:
        v.append("no audio stream")
    else:
        if result.audio_codec != "aac":
            v.append(f"audio codec is {result.audio_codec}, expected aac")
        elif result.audio_profile not in (None, "LC"):
            v.append(f"AAC profile is {result.audio_profile}, expected LC")
        if result.sample_rate != CONTRACT_SAMPLE_RATE:
            v.append(f"sample rate is {result.sample_rate} Hz, expected {CONTRACT_SAMPLE_RATE}")
        if result.channels != CONTRACT_CHANNELS:
            v.append(f"{result.channels} audio channels, expected {CONTRACT_CHANNELS}")
        if result.nb_frames is not None and result.audio_duration is not None:
            expected = result.nb_frames / CONTRACT_FPS_VALUE
            tolerance = 1 / CONTRACT_FPS_VALUE + AAC_FRAME_SAMPLES / CONTRACT_SAMPLE_RATE
            if abs(result.audio_duration - expected) > tolerance:
                v.append(
                    f"audio lasts {result.audio_duration:.3f} s, expected {expected:.3f} s "
                    f"(frames/24) within {tolerance:.3f} s"
                )
    if result.decode_errors:
        shown = "; ".join(result.decode_errors[:3])
        more = f" (+{len(result.decode_errors) - 3} more)" if len(result.decode_errors) > 3 else ""
        v.append(f"decode errors: {shown}{more}")
    return v


def summary_line(result: ProbeResult) -> str:
    """One line describing ``result``, e.g. ``out.mp4: h264 yuv420p 1344x768 24/1 124f | aac ... | 5.167s | pyav``.

    The last part is the reader (when known); ``| N decode errors`` precedes it when there are any.
    """
    by = f" | {result.reader}" if result.reader is not None else ""
    if result.error is not None:
        return f"{result.path}: ERROR {result.error}{by}"
    if result.video_codec is None:
        vpart = "no video"
    else:
        vpart = (
            f"{result.video_codec} {result.pix_fmt} {result.width}x{result.height} "
            f"{result.r_frame_rate} {result.nb_frames}f"
        )
    if result.audio_codec is None:
        apart = "no audio"
    else:
        dur = f"{result.audio_duration:.3f}s" if result.audio_duration is not None else "?s"
        apart = f"{result.audio_codec} {result.sample_rate}Hz {result.channels}ch {dur}"
    total = f"{result.duration:.3f}s" if result.duration is not None else "?s"
    errs = f" | {len(result.decode_errors)} decode errors" if result.decode_errors else ""
    return f"{result.path}: {vpart} | {apart} | {total}{errs}{by}"
