"""The two readers behind `probe` agree: on the same files (a good h3serve MP4, a truncated one, a header-only one,
a file without audio, a non-media file, a missing path, a directory) PyAV gives the ffprobe reader's fields and
`check_output_contract` the same verdicts. The PyAV reader is forced by hiding the binaries from PATH; the PyAV-only
tests need no ffmpeg at all (every file here is written with PyAV)."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import av
import av.logging
import numpy as np
import pytest
from ffmpeg_path import hide_ffmpeg

from h3serve.media.mp4 import EncoderOptions, write_mp4
from h3serve.media.output_probe import NO_STREAMS, ProbeResult, check_output_contract, decode_errors, probe

HAVE_FFMPEG = shutil.which("ffprobe") is not None and shutil.which("ffmpeg") is not None
needs_ffmpeg = pytest.mark.skipif(not HAVE_FFMPEG, reason="needs ffmpeg/ffprobe to compare with")
FRAMES, H, W = 124, 32, 64


def content(frames: int = FRAMES) -> tuple[np.ndarray, np.ndarray]:
    t = np.arange(frames, dtype=np.float32)[:, None, None]
    x = np.arange(W, dtype=np.float32)[None, None, :] / W
    gray = 0.5 + 0.4 * np.sin(2 * np.pi * (x + t / 40)) * np.ones((1, H, 1), np.float32)
    video = np.repeat(gray[..., None], 3, axis=-1).astype(np.float32)
    s = np.arange(frames * 32000 // 24) / 32000
    audio = np.stack([np.sin(2 * np.pi * 300 * s), np.sin(2 * np.pi * 500 * s)]) * 0.4
    return video, audio.astype(np.float32)


def write_silent(path: Path) -> None:
    """124 frames of H.264 at 24 fps and no audio stream, written directly with PyAV."""
    with av.open(str(path), "w") as out:
        stream = out.add_stream("libx264", rate=24)
        stream.width, stream.height, stream.pix_fmt = W, H, "yuv420p"
        for frame in (content()[0] * 255).astype(np.uint8):
            out.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        out.mux(stream.encode())


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("readers")
    good = root / "good.mp4"
    write_mp4(good, *content(), options=EncoderOptions(preset="veryfast"))
    data = good.read_bytes()
    made = {"good": good, "truncated": root / "truncated.mp4", "head": root / "head.mp4", "silent": root / "silent.mp4"}
    made["truncated"].write_bytes(data[: len(data) * 2 // 3])  # the moov (at the front) still parses
    made["head"].write_bytes(data[:200])
    write_silent(made["silent"])
    made["junk"] = root / "junk.mp4"
    made["junk"].write_bytes(np.random.default_rng(0).bytes(5000))
    made["missing"], made["directory"] = root / "absent.mp4", root
    return made


def verdicts(result: ProbeResult) -> list[str]:
    """The contract's verdicts, with the reader's own wording of an unreadable file or a decode error cut off."""
    return [
        v.split(":")[0] if v.startswith(("unreadable:", "decode errors:")) else v for v in check_output_contract(result)
    ]


@needs_ffmpeg
@pytest.mark.parametrize("name", ["good", "truncated", "head", "silent", "junk", "missing", "directory"])
def test_pyav_reads_what_ffprobe_reads(files, name, monkeypatch):
    ours = probe(files[name])
    hide_ffmpeg(monkeypatch)
    theirs = probe(files[name])
    assert (ours.reader, theirs.reader) == ("ffprobe", "pyav")
    assert verdicts(theirs) == verdicts(ours)
    assert (theirs.error is None) == (ours.error is None) and bool(theirs.decode_errors) == bool(ours.decode_errors)
    if ours.error is not None and ours.error.startswith("ffprobe cannot read"):  # each reader words it its own way
        assert theirs.error.startswith("PyAV cannot read the file: ")
    else:
        assert theirs.error == ours.error
    assert theirs.duration == pytest.approx(ours.duration, abs=2e-3)  # mvhd vs streams: libav versions differ
    same = dict(reader=None, error=None, decode_errors=(), duration=None)
    assert dataclasses.replace(theirs, **same) == dataclasses.replace(ours, **same)


def test_pyav_alone_checks_the_contract(files, monkeypatch):
    """No ffprobe/ffmpeg on PATH: no RuntimeError, every field read, each file's verdict."""
    hide_ffmpeg(monkeypatch)
    good = probe(files["good"])
    assert good == ProbeResult(
        path=str(files["good"]), video_codec="h264", pix_fmt="yuv420p", width=W, height=H, r_frame_rate="24/1",
        nb_frames=FRAMES, audio_codec="aac", audio_profile="LC", sample_rate=32000, channels=2,
        audio_samples=good.audio_samples, audio_duration=good.audio_samples / 32000, duration=good.duration,
        reader="pyav",
    )  # fmt: skip
    assert abs(good.audio_duration - FRAMES / 24) <= 1024 / 32000 and abs(good.duration - FRAMES / 24) < 0.05
    assert check_output_contract(good) == [] and decode_errors(files["good"]) == ()

    truncated = probe(files["truncated"])
    assert truncated.nb_frames < FRAMES and truncated.decode_errors
    assert any(v.startswith("decode errors: ") for v in check_output_contract(truncated))
    assert decode_errors(files["truncated"]) == truncated.decode_errors

    assert check_output_contract(probe(files["silent"])) == ["no audio stream"]
    assert check_output_contract(probe(files["head"])) == [f"unreadable: {NO_STREAMS}"]
    junk = probe(files["junk"])
    assert junk.error.startswith("PyAV cannot read the file: ") and "moov atom not found" in junk.error
    assert decode_errors(files["junk"])  # not a media file: the decode check says so too
    assert check_output_contract(probe(files["missing"])) == ["unreadable: file not found"]
    assert check_output_contract(probe(files["directory"])) == ["unreadable: not a regular file"]


def test_pyav_reader_leaves_the_logging_settings_as_it_found_them(files, monkeypatch):
    hide_ffmpeg(monkeypatch)
    level, skip = av.logging.get_level(), av.logging.get_skip_repeated()
    for name in ("truncated", "junk"):  # the same errors again: PyAV must not fold them into the first run's
        first, again = probe(files[name]), probe(files[name])
        assert again == first and (first.error or first.decode_errors)
    assert "moov atom not found" in again.error
    assert (av.logging.get_level(), av.logging.get_skip_repeated()) == (level, skip)
