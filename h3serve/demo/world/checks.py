"""Semantic checks on generated demo-world clips: measure colour, motion, pitch, pan and clicks from the output.

Inputs are decoded clips: video uint8 [T, H, W, 3] and audio float [2, N] at 32 kHz. The measurements tolerate
blur, slight colour shifts and noise, and fail on wrong content.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from h3serve.demo.world.grammar import BACKGROUND_RGB, COLOR_RGB, Attributes
from h3serve.demo.world.scenes import horizontal_speed, object_size, vertical_speed
from h3serve.rules.limits import AUDIO_SAMPLE_RATE, FPS

FOREGROUND_DISTANCE = 50  # a channel this far from the video's median (background) colour marks the object
MIN_COLOR_COSINE = 0.9  # the measured colour's direction (from the background) must be this close to a named one
STILL_RATIO = 0.25  # median speed below this fraction of the world's speed: the object "barely moves"
WRAP_JUMP = 1 / 3  # a centroid step over this fraction of the canvas is a wrap (or a glitch), not motion
# A generated clip's motion is made in latent frames of 4 video frames: the decoder may draw an object still within
# a latent frame and move it at the next, so motion is measured over MOTION_WINDOW frames, not between two frames.
MOTION_WINDOW = 4
REBOUND_WINDOW = 6  # frames each side of a rebound in which the object must rise by REBOUND_RISE * size
REBOUND_RISE = 0.75  # a rebound is a V (~40 px in 6 frames), an apex a smooth U (~8 px)
REBOUND_SEPARATION = 6  # frames
OSCILLATION_FRACTION = 0.2  # bouncing: at least this share of steps go down, and this share up, ...
OSCILLATION_SPEED = 2.0  # ... each faster than this multiple of the steady vertical speed
LOW_MAX_HZ, HIGH_MIN_HZ, MIN_PITCH_HZ = 600.0, 1000.0, 60.0
CLICK_CUTOFF_HZ = 4000.0
CLICK_WINDOWS_PER_FRAME = 4
CLICK_RATIO = 6.0  # a click window's high-band power over the median window's
CLICK_MIN_POWER = 1e-4  # ... and over this (RMS 0.01), so a silent high band flags nothing
EDGE_TAPER_SECONDS = 0.01  # fades the audio's ends before the high-pass, so the clip's edges do not ring
PAN_MIN_CORRELATION = 0.5
PAN_MIN_SPREAD = 0.5  # px: a centroid steadier than this (std over frames) says nothing about the pan
KEYFRAME_MIN_PSNR = 20.0
HORIZONTAL = ("moving left", "moving right")


# -- video ------------------------------------------------------------------------------------------------------------


def _check_video(video: np.ndarray) -> np.ndarray:
    video = np.asarray(video)
    if video.ndim != 4 or video.shape[-1] != 3:
        raise ValueError(f"video must be [T, H, W, 3], got {video.shape}")
    return video


def background_color(video: np.ndarray) -> np.ndarray:
    """The per-video median colour (the object covers a few percent of the canvas), float64 [3]."""
    video = _check_video(video)
    step = max(1, len(video) // 16)
    return np.median(video[::step].reshape(-1, 3).astype(np.float64), axis=0)


def _distance(video: np.ndarray, background: np.ndarray) -> np.ndarray:
    """Each pixel's largest channel difference from the background, float32 [T, H, W]."""
    channels = [np.abs(video[..., c].astype(np.float32) - np.float32(background[c])) for c in range(3)]
    return np.maximum(np.maximum(channels[0], channels[1]), channels[2])


@dataclass(frozen=True)
class _Layers:
    """What the video measurements share: the background colour, each pixel's distance from it, the object mask."""

    background: np.ndarray
    distance: np.ndarray
    mask: np.ndarray


def _layers(video: np.ndarray) -> _Layers:
    background = background_color(video)
    distance = _distance(video, background)
    return _Layers(background, distance, distance > FOREGROUND_DISTANCE)


def foreground(video: np.ndarray) -> np.ndarray:
    """Object pixels: some channel clearly off the background colour; bool [T, H, W]."""
    return _layers(_check_video(video)).mask


def _dilate(mask: np.ndarray) -> np.ndarray:
    """3x3 dilation of [T, H, W] on the torus."""
    grown = mask.copy()
    for dy in (-1, 0, 1):
        for dx in (-1, 0, 1):
            grown |= np.roll(mask, (dy, dx), axis=(1, 2))
    return grown


def _circular_mean(weights: np.ndarray, axis: int, period: int) -> np.ndarray:
    """Weighted circular mean of pixel centres (i + 0.5) along `axis` of [T, H, W], in [0, period)."""
    angle = 2 * np.pi * (np.arange(period) + 0.5) / period
    profile = weights.sum(axis=axis)  # [T, period]
    mean = np.arctan2(profile @ np.sin(angle), profile @ np.cos(angle))
    return np.mod(mean / (2 * np.pi) * period, period)


def _full_distance(layers: _Layers) -> float:
    """The distance of a fully covered object pixel (a high percentile over the mask)."""
    return float(np.percentile(layers.distance[layers.mask], 90)) if layers.mask.any() else 1.0


def _centroids(layers: _Layers) -> np.ndarray:
    """Coverage-weighted toroidal centroids per frame [T, 2] as (x, y); nan where a frame has too little object."""
    _, height, width = layers.mask.shape
    weights = np.clip(layers.distance / _full_distance(layers), 0.0, 1.0) * _dilate(layers.mask)
    result = np.stack([_circular_mean(weights, 1, width), _circular_mean(weights, 2, height)], axis=1)
    enough = layers.mask.sum(axis=(1, 2)) >= max(4.0, object_size(height) ** 2 / 8)
    result[~enough] = np.nan
    return result


def centroids(video: np.ndarray) -> np.ndarray:
    """The object's centre per frame, float64 [T, 2] as (x, y) in pixels; nan where no object is visible.

    A toroidal mean, so an object wrapped across an edge gets its true centre (near that edge).
    """
    return _centroids(_layers(_check_video(video)))


def color_cosines(offset: np.ndarray) -> dict[str, float]:
    """The cosine between a colour's offset from its background (RGB [3]) and each named colour's offset from the
    world's background: the direction `measure_color` names a colour by."""
    offset = np.asarray(offset, dtype=np.float64)
    cosines = {}
    for name, rgb in COLOR_RGB.items():
        reference = np.asarray(rgb, dtype=np.float64) - np.asarray(BACKGROUND_RGB, dtype=np.float64)
        cosines[name] = float(offset @ reference / (np.linalg.norm(offset) * np.linalg.norm(reference) + 1e-9))
    return cosines


def _color_from(video: np.ndarray, layers: _Layers) -> str | None:
    if not layers.mask.any():
        return None
    core = layers.mask & (layers.distance >= 0.5 * _full_distance(layers))
    mean = video[core].astype(np.float64).mean(axis=0) - layers.background
    best, best_cosine = None, MIN_COLOR_COSINE
    for name, cosine in color_cosines(mean).items():
        if cosine >= best_cosine:
            best, best_cosine = name, cosine
    return best


def measure_color(video: np.ndarray) -> str | None:
    """The named colour nearest the object's mean colour (by direction from the background); None if no object."""
    video = _check_video(video)
    return _color_from(video, _layers(video))


def _wrapped(step: np.ndarray, period: int) -> np.ndarray:
    return np.mod(step + period / 2, period) - period / 2


def _steps(points: np.ndarray, width: int, height: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-frame centroid steps (dx, dy) averaged over MOTION_WINDOW consecutive steps, between frames that show the
    object; on the torus, and jumps (wraps, glitches) left out."""
    dx = _wrapped(np.diff(points[:, 0]), width)
    dy = _wrapped(np.diff(points[:, 1]), height)
    keep = np.isfinite(dx) & np.isfinite(dy) & (np.abs(dx) <= width * WRAP_JUMP) & (np.abs(dy) <= height * WRAP_JUMP)
    return _window_mean(dx, keep), _window_mean(dy, keep)


def _window_mean(steps: np.ndarray, keep: np.ndarray) -> np.ndarray:
    """Mean of the kept steps in each run of MOTION_WINDOW consecutive steps that are all kept."""
    if len(steps) < MOTION_WINDOW:
        return steps[keep]
    kernel = np.ones(MOTION_WINDOW)
    sums = np.convolve(np.where(keep, steps, 0.0), kernel, mode="valid")
    whole = np.convolve(keep.astype(float), kernel, mode="valid") == MOTION_WINDOW
    return sums[whole] / MOTION_WINDOW


def _rebounds_from(cy: np.ndarray, height: int) -> list[int]:
    """Frames where the centre is lowest locally, near the bottom, and clearly rises on both sides."""
    size = object_size(height)
    floor_level = height - 1.5 * size  # within one size of the lowest centre reachable, height - size / 2
    rise = REBOUND_RISE * size
    candidates = []
    for f in range(1, len(cy) - 1):
        near = cy[f - 1 : f + 2]
        left = cy[max(0, f - REBOUND_WINDOW) : f]
        right = cy[f + 1 : f + 1 + REBOUND_WINDOW]
        if not np.all(np.isfinite(near)) or cy[f] < floor_level or cy[f] < near.max():
            continue
        if np.nanmin(left, initial=np.inf) <= cy[f] - rise and np.nanmin(right, initial=np.inf) <= cy[f] - rise:
            candidates.append(_plateau_middle(cy, f))
    kept: list[int] = []
    for f in sorted(candidates, key=lambda f: (-cy[f], f)):
        if all(abs(f - k) >= REBOUND_SEPARATION for k in kept):
            kept.append(f)
    return sorted(kept)


def _plateau_middle(cy: np.ndarray, f: int) -> int:
    """The middle frame of the run of frames around `f` at (within 0.5 px of) its height: a generated bounce may
    rest a latent frame (4 frames) at the bottom, and its impact is then the run's middle, not its first frame."""
    start = end = f
    while start > 0 and abs(cy[start - 1] - cy[f]) <= 0.5:
        start -= 1
    while end + 1 < len(cy) and abs(cy[end + 1] - cy[f]) <= 0.5:
        end += 1
    return (start + end) // 2


def rebound_frames(video: np.ndarray) -> list[int]:
    """Frames where the object is at a local lowest point close to the bottom (bounces), >= 6 frames apart."""
    video = _check_video(video)
    return _rebounds_from(centroids(video)[:, 1], video.shape[1])


def _oscillates(dy: np.ndarray, height: int) -> bool:
    """Whether the object goes both down and up, each in a good share of steps, faster than twice the steady speed."""
    threshold = OSCILLATION_SPEED * vertical_speed(height) / FPS
    if len(dy) == 0:
        return False
    down, up = np.mean(dy > threshold), np.mean(dy < -threshold)
    return bool(down >= OSCILLATION_FRACTION and up >= OSCILLATION_FRACTION)


def _motion_from(points: np.ndarray, width: int, height: int) -> str | None:
    dx, dy = _steps(points, width, height)
    if len(dx) == 0:
        return None
    if _oscillates(dy, height):  # a bounce, or an up-and-down that is none of the five motions
        return "bouncing" if len(_rebounds_from(points[:, 1], height)) >= 2 else None
    along_x = float(np.median(dx)) / (horizontal_speed(width) / FPS)
    along_y = float(np.median(dy)) / (vertical_speed(height) / FPS)
    if max(abs(along_x), abs(along_y)) < STILL_RATIO:
        return None
    if abs(along_x) >= abs(along_y):
        return "moving right" if along_x > 0 else "moving left"
    return "moving down" if along_y > 0 else "moving up"


def measure_motion(video: np.ndarray) -> str | None:
    """One of the five motions from the centroid track; None if the object is missing or barely moves."""
    video = _check_video(video)
    return _motion_from(centroids(video), video.shape[2], video.shape[1])


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    """Peak signal-to-noise ratio (dB) of two uint8 images of one shape; inf when identical."""
    a, b = np.asarray(a), np.asarray(b)
    if a.shape != b.shape:
        raise ValueError(f"shapes differ: {a.shape} vs {b.shape}")
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return math.inf if mse == 0 else 10 * math.log10(255.0**2 / mse)


def _object_in(image: np.ndarray) -> tuple[np.ndarray, str | None] | None:
    """The object's centre (x, y) and named colour in one image; None if it shows no object."""
    layers = _layers(image[None])
    centre = _centroids(layers)[0]
    return None if np.isnan(centre).any() else (centre, _color_from(image[None], layers))


def check_keyframe(video: np.ndarray, keyframe: np.ndarray, frame: int = 0) -> bool:
    """FL2VA: the frame the keyframe pins (0 for a first keyframe, -1 for a last one) reproduces it (as the pipeline
    put it on the canvas): PSNR >= 20 dB, and an object in both or in neither, of the same named colour with centres
    within size / 2. (On a mostly-background canvas PSNR alone passes a frame without the object, ~22.7 dB, or
    another colour and shape in the same place, ~20.2 dB.)"""
    first = _check_video(video)[frame]
    if psnr(first, keyframe) < KEYFRAME_MIN_PSNR:
        return False
    wanted, found = _object_in(np.asarray(keyframe)), _object_in(first)
    if wanted is None or found is None:
        return wanted is None and found is None
    if found[1] != wanted[1]:
        return False
    height, width = first.shape[:2]
    offset = found[0] - wanted[0]
    distance = math.hypot(_wrapped(offset[0], width), _wrapped(offset[1], height))
    return distance <= object_size(height) / 2


# -- audio ------------------------------------------------------------------------------------------------------------


def _check_audio(audio: np.ndarray) -> np.ndarray:
    audio = np.asarray(audio, dtype=np.float64)
    if audio.ndim != 2 or audio.shape[0] != 2:
        raise ValueError(f"audio must be [2, N], got {audio.shape}")
    return audio


def measure_pitch(audio: np.ndarray) -> str | None:
    """The sound from the spectral peak (>= 60 Hz) of the channels' mean: below 600 Hz "low hum", above 1 kHz
    "high beep"; None in between or when silent."""
    mono = _check_audio(audio).mean(axis=0)
    if len(mono) == 0 or np.sqrt(np.mean(mono**2)) < 1e-4:
        return None
    spectrum = np.abs(np.fft.rfft(mono))
    freqs = np.fft.rfftfreq(len(mono), 1 / AUDIO_SAMPLE_RATE)
    spectrum[freqs < MIN_PITCH_HZ] = 0.0
    peak = freqs[int(np.argmax(spectrum))]
    if peak < LOW_MAX_HZ:
        return "low hum"
    return "high beep" if peak > HIGH_MIN_HZ else None


def _frame_bounds(frame: int, per_second: float = FPS) -> tuple[int, int]:
    return round(frame * AUDIO_SAMPLE_RATE / per_second), round((frame + 1) * AUDIO_SAMPLE_RATE / per_second)


def _high_band(mono: np.ndarray) -> np.ndarray:
    """The signal above CLICK_CUTOFF_HZ (FFT high-pass), its ends faded out first."""
    taper = min(round(EDGE_TAPER_SECONDS * AUDIO_SAMPLE_RATE), len(mono) // 2)
    fade = 0.5 - 0.5 * np.cos(np.pi * (np.arange(taper) + 0.5) / taper)
    mono = mono.copy()
    mono[:taper] *= fade
    mono[len(mono) - taper :] *= fade[::-1]
    spectrum = np.fft.rfft(mono)
    spectrum[np.fft.rfftfreq(len(mono), 1 / AUDIO_SAMPLE_RATE) < CLICK_CUTOFF_HZ] = 0.0
    return np.fft.irfft(spectrum, n=len(mono))


def _hot_runs(hot: np.ndarray) -> list[tuple[int, int]]:
    """(first, last) indices of runs of True, runs one False apart joined."""
    runs: list[tuple[int, int]] = []
    for index in np.flatnonzero(hot):
        if runs and index - runs[-1][1] <= 2:
            runs[-1] = (runs[-1][0], int(index))
        else:
            runs.append((int(index), int(index)))
    return runs


def click_frames(audio: np.ndarray) -> list[int]:
    """Video-frame indices of clicks: bursts of energy above 4 kHz, well over the median level, adjacent ones merged."""
    mono = _check_audio(audio).mean(axis=0)
    rate = FPS * CLICK_WINDOWS_PER_FRAME
    count = int(len(mono) * rate // AUDIO_SAMPLE_RATE)
    if count < 3:
        return []
    high = _high_band(mono)
    bounds = [_frame_bounds(w, rate) for w in range(count)]
    power = np.array([np.mean(high[a:b] ** 2) for a, b in bounds])
    hot = power > max(CLICK_RATIO * float(np.median(power)), CLICK_MIN_POWER)
    frames: list[int] = []
    for first, last in _hot_runs(hot):
        start, end = bounds[first][0], bounds[last][1]
        burst = np.abs(high[start:end])
        onset = start + int(np.argmax(burst >= 0.5 * burst.max()))
        frame = math.floor(onset * FPS / AUDIO_SAMPLE_RATE + 0.5)
        if not frames or frame - frames[-1] > 1:
            frames.append(frame)
    return frames


def clicks_match(rebounds: list[int], clicks: list[int], tolerance: int = 2) -> bool:
    """Every rebound has a click within `tolerance` frames."""
    return all(any(abs(r - c) <= tolerance for c in clicks) for r in rebounds)


def _pan_from(cx: np.ndarray, width: int, audio: np.ndarray) -> float:
    """`pan_follows` from the centroids' x."""
    position = cx / width
    jump = np.abs(np.diff(cx)) > width * WRAP_JUMP  # steps that crossed the edge
    near_jump = np.zeros(len(cx), dtype=bool)
    near_jump[:-1] |= jump
    near_jump[1:] |= jump
    balance = np.full(len(cx), np.nan)
    for f in range(len(cx)):
        a, b = _frame_bounds(f)
        if b > audio.shape[1] or not np.isfinite(cx[f]) or near_jump[f]:
            continue
        left, right = np.sum(audio[0, a:b] ** 2), np.sum(audio[1, a:b] ** 2)
        balance[f] = (right - left) / (right + left + 1e-12)
    keep = np.isfinite(balance)
    if keep.sum() < 3 or np.std(cx[keep]) < PAN_MIN_SPREAD or np.std(balance[keep]) == 0:
        return math.nan
    return float(np.corrcoef(position[keep], balance[keep])[0, 1])


def pan_follows(video: np.ndarray, audio: np.ndarray) -> float:
    """Pearson correlation, over frames showing the object, of its x / W and the audio's (R - L) / (R + L) energy.

    nan when undefined (the object hardly moves sideways, or under three usable frames). Frames next to an edge
    crossing are left out; so are frames the audio does not fully cover.
    """
    video = _check_video(video)
    return _pan_from(centroids(video)[:, 0], video.shape[2], _check_audio(audio))


# -- verdicts ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Verdict:
    """Named check results and their summary."""

    checks: dict[str, bool]

    @property
    def passed(self) -> bool:
        return all(self.checks.values())

    @property
    def failed(self) -> list[str]:
        return [name for name, ok in self.checks.items() if not ok]


def check_t2va(video: np.ndarray, audio: np.ndarray, attrs: Attributes) -> dict[str, bool]:
    """Does a clip show and sound what `attrs` asks for? Keys: color and pitch (when attrs set them), motion,
    pan (moving left/right: pan follows the object), rebounds (bouncing: >= 2) and clicks (bouncing: a click within
    2 frames of each rebound)."""
    video, audio = _check_video(video), _check_audio(audio)
    height, width = video.shape[1:3]
    layers = _layers(video)
    points = _centroids(layers)
    checks: dict[str, bool] = {}
    if attrs.color is not None:
        checks["color"] = _color_from(video, layers) == attrs.color
    checks["motion"] = _motion_from(points, width, height) == attrs.motion
    if attrs.sound is not None:
        checks["pitch"] = measure_pitch(audio) == attrs.sound
    if attrs.motion in HORIZONTAL:
        checks["pan"] = _pan_from(points[:, 0], width, audio) > PAN_MIN_CORRELATION
    if attrs.motion == "bouncing":
        rebounds = _rebounds_from(points[:, 1], height)
        checks["rebounds"] = len(rebounds) >= 2
        checks["clicks"] = bool(rebounds) and clicks_match(rebounds, click_frames(audio))
    return checks


def verdict_t2va(video: np.ndarray, audio: np.ndarray, attrs: Attributes) -> Verdict:
    """`check_t2va` as a Verdict."""
    return Verdict(check_t2va(video, audio, attrs))

