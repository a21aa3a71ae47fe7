"""Fidelity metrics on synthetic arrays with known answers."""

from __future__ import annotations

import math

import numpy as np
import pytest

from h3serve.media import fidelity


@pytest.fixture(scope="module")
def frames() -> np.ndarray:
    rng = np.random.default_rng(0)
    return rng.uniform(0.2, 0.8, (5, 24, 32, 3)).astype(np.float32)


def test_psnr_identical_is_infinite_and_noise_matches_its_sigma(frames):
    assert fidelity.psnr(frames, frames.copy()) == math.inf
    sigma = 0.02
    noisy = frames + np.random.default_rng(1).normal(0, sigma, frames.shape).astype(np.float32)
    assert fidelity.psnr(frames, noisy) == pytest.approx(20 * math.log10(1 / sigma), abs=0.2)  # 33.98 dB
    assert fidelity.psnr(frames, frames + 0.1) == pytest.approx(20.0, abs=1e-3)


def test_mse_chunks_cover_every_frame():
    a = np.zeros((40, 2, 2, 3), np.float32)  # more frames than one chunk
    b = a.copy()
    b[-1] = 1.0  # only the last frame differs
    assert fidelity.mse(a, b) == pytest.approx(1 / 40)
    assert fidelity.max_abs_diff(a, b) == 1.0


def test_cosine(frames):
    assert fidelity.cosine(frames, 3 * frames) == pytest.approx(1.0)
    assert fidelity.cosine(np.array([1.0, 0.0]), np.array([0.0, 2.0])) == 0.0
    assert fidelity.cosine(np.zeros(4), np.zeros(4)) == 1.0
    assert fidelity.cosine(np.zeros(4), np.ones(4)) == 0.0
    with pytest.raises(ValueError, match="shapes differ"):
        fidelity.cosine(np.zeros(3), np.zeros(4))


def _tone(hz: float, seconds: float = 1.0, amplitude: float = 0.5) -> np.ndarray:
    t = np.arange(int(32_000 * seconds)) / 32_000
    wave = amplitude * np.sin(2 * np.pi * hz * t)
    return np.stack([wave, wave]).astype(np.float32)


def test_snr():
    ref = _tone(440)
    assert fidelity.snr(ref, ref) == math.inf
    assert fidelity.snr(ref, 0.9 * ref) == pytest.approx(20.0, abs=1e-4)  # error is 10% of the signal
    assert fidelity.snr(np.zeros_like(ref), ref) == -math.inf


def test_log_mel_cosine_reacts_to_pitch_and_level_not_to_identity():
    ref = _tone(440)
    assert fidelity.log_mel_cosine(ref, ref) == pytest.approx(1.0)
    other_pitch = fidelity.log_mel_cosine(ref, _tone(3000))
    quieter = fidelity.log_mel_cosine(ref, _tone(440, amplitude=0.05))
    assert other_pitch < 0.9
    assert 0.5 < quieter < 0.99
    assert fidelity.log_mel_cosine(np.zeros((2, 500)), np.zeros((2, 500))) == 1.0  # shorter than one frame


def test_mel_filterbank_covers_the_spectrum():
    bank = fidelity.mel_filterbank(32_000)
    assert bank.shape == (fidelity.MEL_BANDS, fidelity.MEL_N_FFT // 2 + 1)
    assert (bank.max(axis=1) > 0.5).all()  # no empty band
    assert (bank.sum(axis=0)[1:-1] > 0).all()  # every inner bin belongs to a band
