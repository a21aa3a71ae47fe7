"""Fidelity of one output against another (`h3serve compare A B`) (MP4 files or `--save-raw` .npz arrays).

Video: PSNR, SSIM (scikit-image, Wang et al. settings) and pixel cosine over the frames both have. Audio: log-mel
cosine and SNR (B against A) over the samples both have. Frame and sample counts are reported side by side.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from h3serve.extras import require
from h3serve.media import fidelity


@dataclass
class DecodedClip:
    """Decoded media: video [T, H, W, 3] float32 in [0, 1], audio [C, N] float32 in [-1, 1]."""

    video: np.ndarray
    audio: np.ndarray


@dataclass
class Comparison:
    frames_a: int
    frames_b: int
    samples_a: int
    samples_b: int
    psnr_db: float
    ssim: float
    pixel_cosine: float
    video_max_abs_diff: float
    mel_cosine: float
    snr_db: float
    audio_max_abs_diff: float

    def to_json(self) -> dict[str, float | int | None]:
        """JSON-safe dict: infinities become null (a JSON number cannot be infinite)."""
        return {k: (None if isinstance(v, float) and math.isinf(v) else v) for k, v in asdict(self).items()}


# Threshold flag -> (metric field, True if the metric must be at least the value, False if at most).
THRESHOLDS = {
    "min_psnr": ("psnr_db", True),
    "min_ssim": ("ssim", True),
    "min_pixel_cosine": ("pixel_cosine", True),
    "min_mel_cosine": ("mel_cosine", True),
    "min_snr": ("snr_db", True),
    "max_abs_diff": ("video_max_abs_diff", False),
    "max_audio_abs_diff": ("audio_max_abs_diff", False),
}


def decode_mp4(path: str | Path) -> DecodedClip:
    """Every video frame (RGB) and every audio sample of an MP4."""
    import av

    with av.open(str(path)) as container:
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
    with av.open(str(path)) as container:
        chunks = [f.to_ndarray() for f in container.decode(audio=0)] if container.streams.audio else []
    video = np.stack(frames).astype(np.float32) / 255.0 if frames else np.zeros((0, 0, 0, 3), np.float32)
    audio = np.concatenate(chunks, axis=-1).astype(np.float32) if chunks else np.zeros((0, 0), np.float32)
    return DecodedClip(video=video, audio=audio)


def load_clip(path: str | Path) -> DecodedClip:
    """An MP4 (decoded) or a `.npz` raw-array file as written by `--save-raw`."""
    if Path(path).suffix.lower() == ".npz":
        from h3serve.media.raw import read_raw

        video, audio = read_raw(path)[:2]
        return DecodedClip(video=np.asarray(video, np.float32), audio=np.asarray(audio, np.float32))
    return decode_mp4(path)


def ssim(a: np.ndarray, b: np.ndarray) -> float:
    """Mean per-frame SSIM of [T, H, W, 3] arrays in [0, 1] (Gaussian window, sigma 1.5; scikit-image)."""
    require("fidelity", "SSIM")
    from skimage.metrics import structural_similarity

    if a.shape != b.shape:
        raise ValueError(f"shapes differ: {a.shape} vs {b.shape}")
    if a.shape[0] == 0:
        return math.nan
    scores = [
        structural_similarity(x, y, channel_axis=-1, data_range=1.0, gaussian_weights=True, sigma=1.5,
                              use_sample_covariance=False)
        for x, y in zip(a, b, strict=True)
    ]
    return float(np.mean(scores))


def compare_clips(a: DecodedClip, b: DecodedClip) -> Comparison:
    """Metrics of `b` against `a` over the frames and samples both have. Different frame sizes are an error."""
    if a.video.shape[1:] != b.video.shape[1:]:
        raise ValueError(f"frame sizes differ: {a.video.shape[1:3]} vs {b.video.shape[1:3]}")
    if a.audio.shape[0] != b.audio.shape[0]:
        raise ValueError(f"audio channel counts differ: {a.audio.shape[0]} vs {b.audio.shape[0]}")
    t = min(a.video.shape[0], b.video.shape[0])
    n = min(a.audio.shape[-1], b.audio.shape[-1])
    va, vb = a.video[:t], b.video[:t]
    aa, ab = a.audio[..., :n], b.audio[..., :n]
    return Comparison(
        frames_a=a.video.shape[0],
        frames_b=b.video.shape[0],
        samples_a=a.audio.shape[-1],
        samples_b=b.audio.shape[-1],
        psnr_db=fidelity.psnr(va, vb),
        ssim=ssim(va, vb),
        pixel_cosine=fidelity.cosine(va, vb),
        video_max_abs_diff=fidelity.max_abs_diff(va, vb),
        mel_cosine=fidelity.log_mel_cosine(aa, ab),
        snr_db=fidelity.snr(aa, ab),
        audio_max_abs_diff=fidelity.max_abs_diff(aa, ab),
    )


def threshold_failures(result: Comparison, limits: dict[str, float | None], same_length: bool = False) -> list[str]:
    """One line per threshold the comparison misses (NaN always misses)."""
    failures = []
    for flag, value in limits.items():
        if value is None:
            continue
        field, at_least = THRESHOLDS[flag]
        got = getattr(result, field)
        ok = got >= value if at_least else got <= value
        if not ok:
            relation = ">=" if at_least else "<="
            failures.append(f"{field} {got:.6g} is not {relation} {value:g} (--{flag.replace('_', '-')})")
    if same_length and (result.frames_a != result.frames_b or result.samples_a != result.samples_b):
        failures.append(
            f"lengths differ: {result.frames_a} vs {result.frames_b} frames, "
            f"{result.samples_a} vs {result.samples_b} samples (--same-length)"
        )
    return failures


def format_comparison(r: Comparison) -> str:
    return "\n".join(
        [
            f"frames   {r.frames_a} vs {r.frames_b}",
            f"samples  {r.samples_a} vs {r.samples_b}",
            f"video    PSNR {r.psnr_db:.2f} dB | SSIM {r.ssim:.5f} | pixel cosine {r.pixel_cosine:.6f} | "
            f"max |diff| {r.video_max_abs_diff:.3g}",
            f"audio    log-mel cosine {r.mel_cosine:.6f} | SNR {r.snr_db:.2f} dB | "
            f"max |diff| {r.audio_max_abs_diff:.3g}",
        ]
    )
