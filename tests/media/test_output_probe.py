"""probe / check_output_contract / summary_line on good, off-contract and broken files, read with ffprobe and with
PyAV (the reader when the ffprobe/ffmpeg binaries are not on PATH, forced here by hiding them)."""

from __future__ import annotations

import dataclasses
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from ffmpeg_path import hide_ffmpeg

from h3serve.media.mp4 import EncoderOptions, write_mp4
from h3serve.media.output_probe import ProbeResult, check_output_contract, probe, summary_line

pytestmark = pytest.mark.skipif(
    shutil.which("ffprobe") is None or shutil.which("ffmpeg") is None, reason="needs ffmpeg/ffprobe"
)

FAST = EncoderOptions(preset="veryfast")


@pytest.fixture(autouse=True, params=["ffprobe", "pyav"])
def reader(request, monkeypatch) -> str:
    """Every test here runs once per reader."""
    if request.param == "pyav":
        hide_ffmpeg(monkeypatch)
    return request.param


def make_content(frames: int, height: int = 32, width: int = 64) -> tuple[np.ndarray, np.ndarray]:
    t = np.arange(frames, dtype=np.float32)[:, None, None]
    x = np.arange(width, dtype=np.float32)[None, None, :] / width
    y = np.arange(height, dtype=np.float32)[None, :, None] / height
    gray = 0.5 + 0.4 * np.sin(2 * np.pi * (x + y + t / 40))
    video = np.repeat(gray[..., None], 3, axis=-1).astype(np.float32)
    s = np.arange(frames * 32000 // 24 + 500) / 32000
    audio = np.stack([np.sin(2 * np.pi * 300 * s), np.sin(2 * np.pi * 500 * s)]) * 0.4
    return video, audio.astype(np.float32)


def ffmpeg(*args: str) -> None:
    subprocess.run(["ffmpeg", "-nostdin", "-v", "error", "-y", *args], check=True)


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("probe") / "good.mp4"
    write_mp4(path, *make_content(124), options=FAST)
    return path


def test_good_file_passes(good, reader):
    r = probe(good)
    assert r.reader == reader
    assert check_output_contract(r) == []
    assert (r.video_codec, r.pix_fmt, r.width, r.height, r.r_frame_rate) == ("h264", "yuv420p", 64, 32, "24/1")
    assert r.nb_frames == 124
    assert (r.audio_codec, r.audio_profile, r.sample_rate, r.channels) == ("aac", "LC", 32000, 2)
    assert r.audio_duration is not None and abs(r.audio_duration - 124 / 24) <= 1024 / 32000
    assert r.duration is not None and abs(r.duration - 124 / 24) < 0.05
    assert r.error is None and r.decode_errors == ()
    line = summary_line(r)
    assert "h264 yuv420p 64x32 24/1 124f" in line and "aac 32000Hz 2ch" in line and "\n" not in line
    assert line.endswith(f" | {reader}")


def test_wrong_frame_count(tmp_path):
    write_mp4(tmp_path / "100.mp4", *make_content(100), options=FAST)
    violations = check_output_contract(probe(tmp_path / "100.mp4"))
    assert len(violations) == 1 and "17n+5" in violations[0]


def test_30fps_file_is_refused(tmp_path):
    out = tmp_path / "30fps.mp4"
    ffmpeg(
        "-f", "lavfi", "-i", "testsrc2=size=64x32:rate=30", "-f", "lavfi", "-i", "sine=frequency=440:sample_rate=32000",
        "-frames:v", "124", "-t", "4.1333", "-ac", "2", "-c:v", "libx264", "-pix_fmt", "yuv420p", "-c:a", "aac",
        str(out),
    )  # fmt: skip
    r = probe(out)
    assert r.r_frame_rate == "30/1" and r.nb_frames == 124
    violations = check_output_contract(r)
    assert any("r_frame_rate is 30/1" in v for v in violations)
    assert any("audio lasts" in v for v in violations)  # 124 frames at 24 fps would need 5.17 s of audio


def test_file_without_audio_is_refused(tmp_path):
    out = tmp_path / "silent.mp4"
    ffmpeg(
        "-f", "lavfi", "-i", "testsrc2=size=64x32:rate=24", "-frames:v", "124",
        "-c:v", "libx264", "-pix_fmt", "yuv420p", str(out),
    )  # fmt: skip
    r = probe(out)
    assert r.audio_codec is None and r.nb_frames == 124
    assert check_output_contract(r) == ["no audio stream"]
    assert "no audio" in summary_line(r)


def test_yuv444_mono_48k_is_refused(tmp_path):
    out = tmp_path / "444.mp4"
    ffmpeg(
        "-f", "lavfi", "-i", "testsrc2=size=64x32:rate=24", "-f", "lavfi", "-i", "sine=sample_rate=48000",
        "-frames:v", "124", "-t", "5.1667", "-c:v", "libx264", "-pix_fmt", "yuv444p", "-c:a", "aac", str(out),
    )  # fmt: skip
    text = "\n".join(check_output_contract(probe(out)))
    assert "pix_fmt is yuv444p" in text and "48000 Hz" in text and "1 audio channels" in text


def test_truncated_file_is_refused(good, tmp_path):
    data = good.read_bytes()
    out = tmp_path / "truncated.mp4"
    out.write_bytes(data[: len(data) * 2 // 3])  # moov is at the front (+faststart): the header still parses
    r = probe(out)
    violations = check_output_contract(r)
    assert violations and any("decode errors" in v or "unreadable" in v for v in violations)
    head = tmp_path / "head.mp4"
    head.write_bytes(data[:200])
    assert check_output_contract(probe(head)) == [
        "unreadable: no video or audio stream (truncated, or not a media file?)"
    ]


def test_corrupt_and_missing_files(tmp_path):
    junk = tmp_path / "junk.mp4"
    junk.write_bytes(np.random.default_rng(0).bytes(5000))
    r = probe(junk)
    assert r.error is not None and check_output_contract(r)[0].startswith("unreadable:")
    assert "ERROR" in summary_line(r)
    missing = probe(tmp_path / "nope.mp4")
    assert check_output_contract(missing) == ["unreadable: file not found"]
    assert check_output_contract(probe(tmp_path))[0] == "unreadable: not a regular file"


def test_audio_duration_tolerance():
    ok = ProbeResult(
        path="x.mp4", video_codec="h264", pix_fmt="yuv420p", width=64, height=32, r_frame_rate="24/1",
        nb_frames=124, audio_codec="aac", audio_profile="LC", sample_rate=32000, channels=2,
        audio_samples=165888, audio_duration=124 / 24, duration=124 / 24,
    )  # fmt: skip
    assert check_output_contract(ok) == []
    tol = 1 / 24 + 1024 / 32000
    assert check_output_contract(dataclasses.replace(ok, audio_duration=124 / 24 + tol - 1e-6)) == []
    assert check_output_contract(dataclasses.replace(ok, audio_duration=124 / 24 - tol + 1e-6)) == []
    late = check_output_contract(dataclasses.replace(ok, audio_duration=124 / 24 + tol + 1e-3))
    assert len(late) == 1 and "audio lasts" in late[0]
    assert check_output_contract(dataclasses.replace(ok, nb_frames=5)) != []  # n >= 1: 5 frames is not allowed
    assert check_output_contract(dataclasses.replace(ok, nb_frames=22, audio_duration=22 / 24)) == []
    errs = check_output_contract(dataclasses.replace(ok, decode_errors=("bad thing",)))
    assert errs == ["decode errors: bad thing"]
