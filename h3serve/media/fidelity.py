"""Fidelity metrics between two outputs (numpy only): PSNR, cosine, max difference, log-mel cosine, SNR.

Video arrays are [T, H, W, 3] float in [0, 1]; audio arrays are [C, N] float in [-1, 1]. Metrics over frames
run chunk by chunk with float64 accumulators, so a 15 s canvas never needs a float64 copy of the whole clip.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np

from h3serve.rules import limits

_CHUNK_FRAMES = 16
MEL_N_FFT = 1024
MEL_HOP = 256
MEL_BANDS = 64
MEL_TOP_DB = 80.0  # dynamic range kept below the louder clip's peak; quieter bins are clipped to the floor


def _chunks(a: np.ndarray, b: np.ndarray) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    for start in range(0, a.shape[0], _CHUNK_FRAMES):
        yield (
            a[start : start + _CHUNK_FRAMES].astype(np.float64),
            b[start : start + _CHUNK_FRAMES].astype(np.float64),
        )


def _check_same_shape(a: np.ndarray, b: np.ndarray) -> None:
    if a.shape != b.shape:
        raise ValueError(f"shapes differ: {a.shape} vs {b.shape}")


def mse(a: np.ndarray, b: np.ndarray) -> float:
    """Mean squared difference of two arrays of the same shape (leading axis chunked)."""
    _check_same_shape(a, b)
    total = sum(float(np.square(x - y).sum()) for x, y in _chunks(a, b))
    return total / max(1, a.size)


def psnr(a: np.ndarray, b: np.ndarray, data_range: float = 1.0) -> float:
    """Peak signal-to-noise ratio in dB; `inf` for identical inputs."""
    err = mse(a, b)
    return math.inf if err == 0.0 else 10.0 * math.log10(data_range**2 / err)


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    """Cosine similarity of the flattened arrays; 1.0 when both are all zero, 0.0 when only one is."""
    _check_same_shape(a, b)
    dot = na = nb = 0.0
    for x, y in _chunks(a, b):
        dot += float((x * y).sum())
        na += float((x * x).sum())
        nb += float((y * y).sum())
    if na == 0.0 and nb == 0.0:
        return 1.0
    if na == 0.0 or nb == 0.0:
        return 0.0
    return dot / math.sqrt(na * nb)


def max_abs_diff(a: np.ndarray, b: np.ndarray) -> float:
    """Largest absolute elementwise difference (0.0 for empty arrays)."""
    _check_same_shape(a, b)
    return max((float(np.abs(x - y).max()) for x, y in _chunks(a, b) if x.size), default=0.0)


def snr(reference: np.ndarray, test: np.ndarray) -> float:
    """Signal-to-noise ratio of `test` against `reference` in dB: signal power over error power.

    `inf` when they are identical; `-inf` when the reference is silent and the test is not.
    """
    _check_same_shape(reference, test)
    ref = reference.astype(np.float64)
    noise = float(np.square(ref - test.astype(np.float64)).sum())
    signal = float(np.square(ref).sum())
    if noise == 0.0:
        return math.inf
    if signal == 0.0:
        return -math.inf
    return 10.0 * math.log10(signal / noise)


def _hz_to_mel(hz: np.ndarray) -> np.ndarray:
    return 2595.0 * np.log10(1.0 + hz / 700.0)


def _mel_to_hz(mel: np.ndarray) -> np.ndarray:
    return 700.0 * (10.0 ** (mel / 2595.0) - 1.0)


def mel_filterbank(sample_rate: int, n_fft: int = MEL_N_FFT, bands: int = MEL_BANDS) -> np.ndarray:
    """Triangular HTK-mel filters [bands, n_fft//2 + 1] from 0 Hz to Nyquist."""
    edges = _mel_to_hz(np.linspace(0.0, _hz_to_mel(np.array(sample_rate / 2.0)), bands + 2))
    bins = np.linspace(0.0, sample_rate / 2.0, n_fft // 2 + 1)
    lower, centre, upper = edges[:-2, None], edges[1:-1, None], edges[2:, None]
    rising = (bins[None] - lower) / (centre - lower)
    falling = (upper - bins[None]) / (upper - centre)
    return np.maximum(0.0, np.minimum(rising, falling))


def mel_power(audio: np.ndarray, sample_rate: int = limits.AUDIO_SAMPLE_RATE) -> np.ndarray:
    """Mel power spectrogram [C, bands, frames] of [C, N] audio (Hann window, zero-padded to one frame)."""
    audio = np.asarray(audio, dtype=np.float64)
    if audio.shape[-1] < MEL_N_FFT:
        audio = np.pad(audio, ((0, 0), (0, MEL_N_FFT - audio.shape[-1])))
    frames = np.lib.stride_tricks.sliding_window_view(audio, MEL_N_FFT, axis=-1)[:, ::MEL_HOP]  # [C, F, n_fft]
    spectrum = np.abs(np.fft.rfft(frames * np.hanning(MEL_N_FFT), axis=-1)) ** 2  # [C, F, bins]
    return np.einsum("mb,cfb->cmf", mel_filterbank(sample_rate), spectrum)


def log_mel_cosine(a: np.ndarray, b: np.ndarray, sample_rate: int = limits.AUDIO_SAMPLE_RATE) -> float:
    """Cosine similarity of two clips' log-mel spectrograms (dB above a shared floor `MEL_TOP_DB` under the peak).

    The shared floor makes silence the zero vector, so the cosine reacts to level and spectral changes instead of
    being dominated by a constant log offset.
    """
    _check_same_shape(a, b)
    db_a, db_b = (10.0 * np.log10(np.maximum(mel_power(x, sample_rate), 1e-10)) for x in (a, b))
    floor = max(float(db_a.max()), float(db_b.max())) - MEL_TOP_DB
    return cosine(np.maximum(db_a, floor) - floor, np.maximum(db_b, floor) - floor)
