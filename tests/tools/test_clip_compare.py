"""`h3serve compare`: identical files, a known distortion, audio changes, thresholds and exit codes."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from h3serve.entrypoints.cli import main
from h3serve.media.mp4 import write_mp4
from h3serve.media.raw import write_raw
from h3serve.tools.clip_compare import compare_clips, load_clip

FRAMES, H, W, SAMPLES = 22, 64, 96, 32_000 * 22 // 24


def _content() -> tuple[np.ndarray, np.ndarray]:
    """Smooth moving colour bars in [0.2, 0.8] (no clipping under small noise) and a two-tone stereo chord."""
    t, y, x = np.meshgrid(np.arange(FRAMES), np.arange(H), np.arange(W), indexing="ij")
    phase = (x + 2 * t) / W * 2 * np.pi
    video = np.stack([np.sin(phase), np.cos(phase + y / H), np.sin(2 * phase)], axis=-1)
    video = (0.5 + 0.3 * video).astype(np.float32)
    s = np.arange(SAMPLES) / 32_000
    audio = np.stack([0.3 * np.sin(2 * np.pi * 440 * s), 0.3 * np.sin(2 * np.pi * 660 * s)]).astype(np.float32)
    return video, audio


@pytest.fixture(scope="module")
def clip():
    return _content()


@pytest.fixture(scope="module")
def mp4(tmp_path_factory, clip):
    path = tmp_path_factory.mktemp("compare") / "a.mp4"
    write_mp4(path, *clip)
    return path


def test_identical_files_give_ssim_one_and_infinite_psnr(mp4, capsys):
    result = compare_clips(load_clip(mp4), load_clip(mp4))
    assert result.psnr_db == math.inf and result.snr_db == math.inf
    assert result.ssim == pytest.approx(1.0, abs=1e-12)
    assert result.pixel_cosine == pytest.approx(1.0) and result.mel_cosine == pytest.approx(1.0)
    assert result.frames_a == result.frames_b == FRAMES
    assert result.samples_a == result.samples_b > 0

    assert main(["compare", str(mp4), str(mp4), "--json", "--min-psnr", "60", "--min-ssim", "0.999"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["psnr_db"] is None and data["ssim"] == pytest.approx(1.0)  # JSON has no infinity: null


def test_known_distortion_lands_in_the_expected_range(tmp_path, clip):
    video, audio = clip
    sigma = 0.02
    noisy = video + np.random.default_rng(0).normal(0, sigma, video.shape).astype(np.float32)
    write_raw(tmp_path / "a.npz", video, audio)
    write_raw(tmp_path / "b.npz", noisy, audio)
    r = compare_clips(load_clip(tmp_path / "a.npz"), load_clip(tmp_path / "b.npz"))
    assert r.psnr_db == pytest.approx(20 * math.log10(1 / sigma), abs=0.2)  # 33.98 dB
    assert 0.5 < r.ssim < 0.99
    assert 0.99 < r.pixel_cosine < 1.0
    assert r.snr_db == math.inf and r.audio_max_abs_diff == 0.0  # the audio did not change


def test_encoded_brightness_shift_against_the_original(tmp_path, clip, mp4):
    video, audio = clip
    write_mp4(tmp_path / "bright.mp4", video + 0.1, audio)
    r = compare_clips(load_clip(mp4), load_clip(tmp_path / "bright.mp4"))
    assert 17.0 < r.psnr_db < 23.0  # a 0.1 shift is 20 dB; the encoder adds a little
    assert r.ssim < 0.99


def test_audio_metrics_react_to_an_audio_change(tmp_path, clip, capsys):
    video, audio = clip
    write_raw(tmp_path / "a.npz", video, audio)
    quieter = (audio * 0.5).astype(np.float32)
    write_raw(tmp_path / "b.npz", video, quieter)
    r = compare_clips(load_clip(tmp_path / "a.npz"), load_clip(tmp_path / "b.npz"))
    assert r.psnr_db == math.inf
    assert r.snr_db == pytest.approx(20 * math.log10(2), abs=1e-3)  # error is half the signal: 6.02 dB
    assert r.mel_cosine < 0.999
    code = main(["compare", str(tmp_path / "a.npz"), str(tmp_path / "b.npz"), "--min-snr", "10"])
    assert code == 1
    assert "snr_db 6.0206 is not >= 10 (--min-snr)" in capsys.readouterr().err


def test_lengths_and_errors(tmp_path, clip, capsys):
    video, audio = clip
    write_raw(tmp_path / "a.npz", video, audio)
    write_raw(tmp_path / "short.npz", video[:10], audio[:, :1000])
    r = compare_clips(load_clip(tmp_path / "a.npz"), load_clip(tmp_path / "short.npz"))
    assert (r.frames_a, r.frames_b, r.samples_a, r.samples_b) == (FRAMES, 10, SAMPLES, 1000)
    assert r.psnr_db == math.inf  # over the frames both have
    assert main(["compare", str(tmp_path / "a.npz"), str(tmp_path / "short.npz"), "--same-length"]) == 1
    assert "lengths differ" in capsys.readouterr().err
    write_raw(tmp_path / "small.npz", video[:, :32], audio)
    assert main(["compare", str(tmp_path / "a.npz"), str(tmp_path / "small.npz")]) == 2
    assert "frame sizes differ" in capsys.readouterr().err
    assert main(["compare", str(tmp_path / "a.npz"), str(tmp_path / "absent.mp4")]) == 2
