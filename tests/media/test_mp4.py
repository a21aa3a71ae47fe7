"""write_mp4: stream properties (checked with the system ffprobe/ffmpeg), fidelity, determinism, validation."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from fmp4_media import decode, ffprobe_streams

from h3serve.media.mp4 import EncoderOptions, audio_samples_for, write_mp4

pytestmark = pytest.mark.skipif(
    shutil.which("ffprobe") is None or shutil.which("ffmpeg") is None, reason="needs ffmpeg/ffprobe"
)

SR = 32000
FAST = EncoderOptions(preset="veryfast")


def make_content(frames: int, height: int, width: int, seed: float = 0.0, extra_audio: int = 700):
    """Smooth moving RGB gradients in [0,1] and a stereo sine pair slightly longer than frames/24 s."""
    t = np.arange(frames, dtype=np.float32)[:, None, None]
    y = np.arange(height, dtype=np.float32)[None, :, None] / height
    x = np.arange(width, dtype=np.float32)[None, None, :] / width
    shape = (frames, height, width)
    r = np.broadcast_to(0.5 + 0.4 * np.sin(np.pi * (x + t / 25 + 2 * seed)), shape)
    g = np.broadcast_to(0.1 + 0.8 * y, shape)
    b = 0.5 + 0.4 * np.cos(np.pi * (y + x - t / 35))
    video = np.stack([r, g, b], axis=-1).astype(np.float32)
    s = np.arange(audio_samples_for(frames, 24, SR) + extra_audio) / SR
    freq = 440.0 * (1 + seed)
    audio = np.stack([0.5 * np.sin(2 * np.pi * freq * s), 0.3 * np.sin(2 * np.pi * 1.5 * freq * s)])
    return video, audio.astype(np.float32)


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()



@pytest.fixture(scope="module", params=[(107, 64, 128), (124, 32, 64)], ids=["107f", "124f"])
def encoded(request, tmp_path_factory):
    frames, height, width = request.param
    video, audio = make_content(frames, height, width)
    path = tmp_path_factory.mktemp("mp4") / f"out{frames}.mp4"
    write_mp4(path, video, audio, options=FAST)
    return path, video, audio


def test_stream_properties(encoded):
    path, video, _ = encoded
    streams = ffprobe_streams(path)
    v, a = streams["video"], streams["audio"]
    assert (v["codec_name"], v["pix_fmt"], v["r_frame_rate"]) == ("h264", "yuv420p", "24/1")
    assert (v["width"], v["height"]) == (video.shape[2], video.shape[1])
    assert int(v["nb_read_frames"]) == int(v["nb_frames"]) == video.shape[0]
    assert v.get("color_space") == "bt709" and v.get("color_range") == "tv"
    assert (a["codec_name"], a["profile"], a["sample_rate"], a["channels"]) == ("aac", "LC", "32000", 2)


def test_full_decode_is_clean(encoded):
    path = encoded[0]
    proc = subprocess.run(
        ["ffmpeg", "-nostdin", "-v", "error", "-i", str(path), "-f", "null", "-"], capture_output=True, text=True
    )
    assert proc.returncode == 0 and proc.stderr == ""


def test_faststart_moov_before_mdat(encoded):
    data = encoded[0].read_bytes()
    assert 0 < data.index(b"moov") < data.index(b"mdat")


def test_decoded_video_matches_input(encoded):
    path, video, _ = encoded
    frames, _ = decode(path)
    assert frames.shape == video.shape
    ref = np.clip(np.rint(video * 255), 0, 255)
    per_frame = np.abs(frames.astype(np.float32) - ref).mean(axis=(1, 2, 3))
    # 4:2:0 chroma subsampling alone costs ~2-3 levels of 255 on frames this small; garbage would cost tens
    assert per_frame.max() < 5.0, per_frame.max()
    # frame order: each decoded frame is closest to its own input frame
    assert np.abs(frames[10].astype(np.float32) - ref[10]).mean() < np.abs(frames[10] - ref[30]).mean()


def test_audio_length_and_content(encoded):
    path, video, audio = encoded
    _, pcm = decode(path)
    n = audio_samples_for(video.shape[0], 24, SR)
    assert pcm.shape[0] == 2
    # trimmed to frames/24 s: the decoder returns whole 1024-sample AAC frames, so at most one frame more
    assert n <= pcm.shape[1] < n + 1024
    assert abs(pcm.shape[1] / SR - video.shape[0] / 24) <= 1024 / SR
    err = pcm[:, 2048 : n - 2048] - audio[:, 2048 : n - 2048]
    assert np.sqrt((err**2).mean()) < 0.02 * np.sqrt((audio**2).mean())
    assert np.abs(pcm[:, n + 100 :]).max(initial=0.0) < 0.05  # what follows the cut is (near) silence


def test_short_audio_is_zero_padded(tmp_path):
    video, audio = make_content(39, 32, 64)
    short = audio[:, : SR // 2]  # 0.5 s for a 1.625 s video
    write_mp4(tmp_path / "pad.mp4", video, short, options=FAST)
    _, pcm = decode(tmp_path / "pad.mp4")
    n = audio_samples_for(39, 24, SR)
    assert n <= pcm.shape[1] < n + 1024
    assert np.abs(pcm[:, SR // 2 + 2048 :]).max() < 0.01
    assert np.abs(pcm[:, : SR // 2 - 2048]).max() > 0.2


def test_byte_identical_reencode(encoded, tmp_path):
    path, video, audio = encoded
    again = tmp_path / "again.mp4"
    write_mp4(again, video.copy(), audio.copy(), options=FAST)
    assert sha256(again) == sha256(path)
    data = again.read_bytes()
    for box in (b"mvhd", b"tkhd", b"mdhd"):  # version 0 boxes: creation and modification time must be 0
        i = data.index(box)
        assert data[i + 4] == 0 and data[i + 8 : i + 16] == bytes(8), box
    assert b"mbtree=0" in data  # x264 SEI: the determinism workaround is active (see mp4._X264_PARAMS)


def test_byte_identical_with_fixed_threads(tmp_path):
    video, audio = make_content(39, 64, 128)
    opts = EncoderOptions(preset="veryfast", threads=2)
    write_mp4(tmp_path / "a.mp4", video, audio, options=opts)
    write_mp4(tmp_path / "b.mp4", video, audio, options=opts)
    assert sha256(tmp_path / "a.mp4") == sha256(tmp_path / "b.mp4")


def test_different_content_gives_different_bytes(encoded, tmp_path):
    path, video, audio = encoded
    other_video, other_audio = make_content(video.shape[0], video.shape[1], video.shape[2], seed=0.25)
    write_mp4(tmp_path / "v.mp4", other_video, audio, options=FAST)
    write_mp4(tmp_path / "a.mp4", video, other_audio, options=FAST)
    digests = {sha256(path), sha256(tmp_path / "v.mp4"), sha256(tmp_path / "a.mp4")}
    assert len(digests) == 3


def test_overwrite_is_atomic_and_leaves_no_temp_files(tmp_path):
    video, audio = make_content(22, 32, 64)
    out = tmp_path / "clip.mp4"
    out.write_bytes(b"old")
    write_mp4(out, video, audio, options=FAST)
    assert out.read_bytes()[4:8] == b"ftyp"
    bad = video.copy()
    bad[15] = np.nan  # fails mid-encode: the previous file must survive and no temp file may remain
    before = sha256(out)
    with pytest.raises(ValueError, match="frame 15"):
        write_mp4(out, bad, audio, options=FAST)
    assert sha256(out) == before
    assert sorted(os.listdir(tmp_path)) == ["clip.mp4"]


def _bad_inputs():
    v, a = make_content(22, 32, 64)
    return {
        "video float64": (v.astype(np.float64), a, {}),
        "video uint8": ((v * 255).astype(np.uint8), a, {}),
        "video 3-D": (v[0], a, {}),
        "video RGBA": (np.concatenate([v, v[..., :1]], axis=-1), a, {}),
        "video no frames": (v[:0], a, {}),
        "odd width": (v[:, :, :63], a, {}),
        "odd height": (v[:, :31], a, {}),
        "audio float64": (v, a.astype(np.float64), {}),
        "audio mono": (v, a[:1], {}),
        "audio [N,2]": (v, np.ascontiguousarray(a.T), {}),
        "audio 1-D": (v, a[0], {}),
        "audio NaN": (v, np.where(np.arange(a.shape[1]) == 5, np.nan, a).astype(np.float32), {}),
        "video list": (v.tolist(), a, {}),
        "fps 0": (v, a, {"fps": 0}),
        "sample_rate not AAC": (v, a, {"sample_rate": 32001}),
        "bad preset": (v, a, {"options": EncoderOptions(preset="warp")}),
        "crf 60": (v, a, {"options": EncoderOptions(crf=60)}),
        "negative threads": (v, a, {"options": EncoderOptions(threads=-1)}),
    }


@pytest.mark.parametrize("case", list(_bad_inputs()))
def test_bad_inputs_raise_value_error(case, tmp_path):
    video, audio, kwargs = _bad_inputs()[case]
    with pytest.raises(ValueError):
        write_mp4(tmp_path / "x.mp4", video, audio, **kwargs)
    assert os.listdir(tmp_path) == []
