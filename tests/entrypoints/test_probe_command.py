"""`h3serve probe`: a contract-conforming output passes; a 30 fps file and a file without audio are refused."""

from __future__ import annotations

import json
from fractions import Fraction

import av
import numpy as np
import pytest
from ffmpeg_path import hide_ffmpeg

from h3serve.entrypoints.cli import main
from h3serve.media.mp4 import write_mp4

FRAMES, H, W = 22, 32, 64


def _frames() -> np.ndarray:
    ramp = np.linspace(0.1, 0.9, FRAMES, dtype=np.float32)[:, None, None, None]
    return np.broadcast_to(ramp, (FRAMES, H, W, 3)).copy()


def _encode(path, fps: int, with_audio: bool) -> None:
    """An H.264 MP4 written directly with PyAV, so it can break the contract on purpose."""
    with av.open(str(path), "w") as out:
        video = out.add_stream("libx264", rate=fps)
        video.width, video.height, video.pix_fmt = W, H, "yuv420p"
        audio = out.add_stream("aac", rate=32_000, layout="stereo") if with_audio else None
        for frame in (_frames() * 255).astype(np.uint8):
            out.mux(video.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        out.mux(video.encode())
        if audio is not None:
            samples = FRAMES * 32_000 // fps
            for start in range(0, samples, 1024):
                n = min(1024, samples - start)
                chunk = av.AudioFrame.from_ndarray(np.zeros((2, n), np.float32), format="fltp", layout="stereo")
                chunk.sample_rate, chunk.pts, chunk.time_base = 32_000, start, Fraction(1, 32_000)
                out.mux(audio.encode(chunk))
            out.mux(audio.encode())


def test_conforming_output_passes(tmp_path, capsys):
    path = tmp_path / "ok.mp4"
    write_mp4(path, _frames(), np.zeros((2, FRAMES * 32_000 // 24), np.float32))
    assert main(["probe", str(path)]) == 0
    assert "h264" in capsys.readouterr().out
    assert main(["probe", str(path), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["violations"] == [] and data["nb_frames"] == FRAMES and data["sample_rate"] == 32_000


@pytest.mark.parametrize(
    "fps, with_audio, reason",
    [(30, True, "r_frame_rate is 30/1, expected 24/1"), (24, False, "no audio stream")],
    ids=["30fps", "no-audio"],
)
def test_contract_violations_are_refused_with_the_reason(tmp_path, capsys, fps, with_audio, reason):
    path = tmp_path / "bad.mp4"
    _encode(path, fps, with_audio)
    assert main(["probe", str(path)]) == 1
    err = capsys.readouterr().err
    violations = [line for line in err.splitlines() if line.startswith("contract violated:")]
    assert violations and any(reason in line for line in violations), err


def test_missing_file_is_refused(tmp_path, capsys):
    assert main(["probe", str(tmp_path / "absent.mp4")]) == 1
    assert "contract violated: unreadable" in capsys.readouterr().err


def test_without_ffmpeg_on_path_pyav_reads_the_file(tmp_path, capsys, monkeypatch):
    """No ffprobe/ffmpeg binaries (PyAV alone): the file is still checked, and the output names the reader."""
    hide_ffmpeg(monkeypatch)
    path = tmp_path / "ok.mp4"
    write_mp4(path, _frames(), np.zeros((2, FRAMES * 32_000 // 24), np.float32))
    assert main(["probe", str(path)]) == 0
    assert capsys.readouterr().out.rstrip().endswith("| pyav")
    assert main(["probe", str(path), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert (data["reader"], data["violations"], data["nb_frames"]) == ("pyav", [], FRAMES)
    bad = tmp_path / "30fps.mp4"
    _encode(bad, 30, True)
    assert main(["probe", str(bad)]) == 1
    assert "contract violated: r_frame_rate is 30/1, expected 24/1" in capsys.readouterr().err
