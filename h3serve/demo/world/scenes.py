"""The demo world's scenes: one object on a dark toroidal canvas, its trajectory, and the rendered video and audio."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from h3serve.demo.world.grammar import (
    BACKGROUND_RGB,
    COLOR_RGB,
    COLORS,
    MOTIONS,
    PITCH_HZ,
    SHAPES,
    SOUNDS,
    Attributes,
)
from h3serve.rules.limits import AUDIO_LATENTS_PER_SECOND, AUDIO_SAMPLE_RATE, FPS

DEFAULT_WIDTH, DEFAULT_HEIGHT, DEFAULT_FRAMES = 128, 64, 107
MIN_HEIGHT = 32
HORIZONTAL_SPEED = 24.0  # px/s on a 128-px-wide canvas, scaled with the width
VERTICAL_SPEED = 10.0  # px/s on a 64-px-high canvas, scaled with the height
DROP_SECONDS = 0.6  # a bouncing object dropped from the top reaches the bottom after this long
REST_DISTANCE = 1.0  # a bouncing object starting this close to the bottom rests there
HORIZONTAL_MARGIN, VERTICAL_MARGIN = 8.0, 4.0  # canonical starts: the gap to the edge the object leaves from
START_JITTER = 2.0  # +- px added to canonical starts when an rng is given
SUPERSAMPLE = 4  # per axis, for the ball's anti-aliased edge (the square's coverage is exact)
TONE_AMPLITUDE = 0.25
SAMPLES_PER_LATENT = AUDIO_SAMPLE_RATE // AUDIO_LATENTS_PER_SECOND  # 800: one audio latent, 25 ms
# The impact click: one audio latent of a 5 kHz sine, on the latent grid nearest the impact (at most 12.5 ms, 0.3
# frames, from it) and in the global phase (125 whole periods a latent, so it starts and ends at zero). A click that
# starts anywhere (a damped ring at the exact impact time, runs 1-5) was never reproduced by the trained audio VAE,
# whatever its loss; one on the grid, as the tones are, is (docs/demo_lab_notebook.md, run 8).
CLICK_AMPLITUDE, CLICK_HZ = 0.3, 5000.0
TASKS = ("t2va", "fl2va")


def object_size(height: int) -> int:
    """The object's edge (the ball's diameter) in pixels on a canvas `height` pixels high."""
    return round(height / 4)


def horizontal_speed(width: int) -> float:
    """Speed of "moving left/right", px/s."""
    return HORIZONTAL_SPEED * width / 128


def vertical_speed(height: int) -> float:
    """Speed of "moving up/down", px/s."""
    return VERTICAL_SPEED * height / 64


def gravity(height: int) -> float:
    """Acceleration (px/s^2) that drops the object from y = 0 to the bottom in DROP_SECONDS."""
    return 2 * (height - object_size(height)) / DROP_SECONDS**2


@dataclass(frozen=True)
class Scene:
    """One clip: what is shown, where the object's top-left corner starts, the canvas size and the frame count."""

    attrs: Attributes
    x0: float
    y0: float
    width: int = DEFAULT_WIDTH
    height: int = DEFAULT_HEIGHT
    frames: int = DEFAULT_FRAMES

    def __post_init__(self) -> None:
        if not self.attrs.complete:
            raise ValueError("a scene needs every attribute (color and sound included)")
        if self.height < MIN_HEIGHT or self.width < object_size(self.height) + 2:
            raise ValueError(f"canvas {self.width}x{self.height} too small (height >= {MIN_HEIGHT})")
        if self.frames < 1:
            raise ValueError("a scene has at least one frame")
        if not (math.isfinite(self.x0) and math.isfinite(self.y0)):
            raise ValueError("start position must be finite")

    @property
    def size(self) -> int:
        """The object's edge in pixels."""
        return object_size(self.height)


def _bounce_fall_seconds(scene: Scene) -> float | None:
    """Time of the first drop to the bottom; None when the object rests (starts within REST_DISTANCE of it)."""
    drop = scene.height - scene.size - scene.y0
    if drop <= REST_DISTANCE:
        return None
    return math.sqrt(2 * drop / gravity(scene.height))


def _positions(scene: Scene, times: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Top-left (x, y) at `times` seconds, unwrapped."""
    x = np.full(times.shape, float(scene.x0))
    y = np.full(times.shape, float(scene.y0))
    motion = scene.attrs.motion
    if motion == "moving left":
        x -= horizontal_speed(scene.width) * times
    elif motion == "moving right":
        x += horizontal_speed(scene.width) * times
    elif motion == "moving up":
        y -= vertical_speed(scene.height) * times
    elif motion == "moving down":
        y += vertical_speed(scene.height) * times
    elif motion == "bouncing" and (fall := _bounce_fall_seconds(scene)) is not None:
        phase = np.mod(times, 2 * fall)
        since_top = fall - np.abs(phase - fall)
        y += 0.5 * gravity(scene.height) * since_top**2
    return x, y


def trajectory(scene: Scene) -> np.ndarray:
    """Top-left positions per frame, float64 [frames, 2] as (x, y); unwrapped (rendering wraps)."""
    x, y = _positions(scene, np.arange(scene.frames) / FPS)
    return np.stack([x, y], axis=1)


def impact_times(scene: Scene, until: float) -> list[float]:
    """Exact times (s) before `until` at which a bouncing object touches the bottom."""
    fall = _bounce_fall_seconds(scene) if scene.attrs.motion == "bouncing" else None
    if fall is None:
        return []
    return [float(t) for t in np.arange(fall, until, 2 * fall)]


def impact_frames(scene: Scene) -> list[int]:
    """The frame nearest each impact within the clip."""
    return [math.floor(t * FPS + 0.5) for t in impact_times(scene, (scene.frames - 0.5) / FPS)]


# -- video ------------------------------------------------------------------------------------------------------------


def _overlap(start: float, size: float, cells: np.ndarray) -> np.ndarray:
    """Length of [start, start + size) inside each unit cell [c, c + 1)."""
    return np.clip(np.minimum(cells + 1, start + size) - np.maximum(cells, start), 0.0, 1.0)


def _disc_coverage(x: float, y: float, size: float, cols: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Fraction of each pixel inside the disc inscribed in the box at (x, y), by SUPERSAMPLE^2 point samples."""
    offsets = (np.arange(SUPERSAMPLE) + 0.5) / SUPERSAMPLE
    radius = size / 2
    dx2 = ((cols[:, None] + offsets).ravel() - (x + radius)) ** 2
    dy2 = ((rows[:, None] + offsets).ravel() - (y + radius)) ** 2
    inside = dy2[:, None] + dx2[None, :] <= radius**2
    return inside.reshape(len(rows), SUPERSAMPLE, len(cols), SUPERSAMPLE).mean(axis=(1, 3))


def _coverage(shape: str, x: float, y: float, size: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The object's bounding pixels (unwrapped rows, cols) and each one's covered fraction [rows, cols]."""
    cols = np.arange(math.floor(x), math.ceil(x + size), dtype=np.float64)
    rows = np.arange(math.floor(y), math.ceil(y + size), dtype=np.float64)
    if shape == "square":
        cover = np.outer(_overlap(y, size, rows), _overlap(x, size, cols))
    else:
        cover = _disc_coverage(x, y, size, cols, rows)
    return rows.astype(np.int64), cols.astype(np.int64), cover


def _paint(canvas: np.ndarray, shape: str, color: str, x: float, y: float, size: float) -> None:
    """Draw the object onto a background-filled uint8 canvas [H, W, 3], wrapping toroidally."""
    paint_rgb(canvas, shape, COLOR_RGB[color], x, y, size, BACKGROUND_RGB)


def paint_rgb(
    canvas: np.ndarray,
    shape: str,
    rgb: tuple[float, float, float],
    x: float,
    y: float,
    size: float,
    background: tuple[float, float, float],
) -> None:
    """Draw a `shape` of colour `rgb`, `size` across with its top-left corner at (x, y), onto a uint8 canvas
    [H, W, 3] filled with `background`, wrapping toroidally (edge pixels blend the two by coverage)."""
    rows, cols, cover = _coverage(shape, x, y, size)
    base = np.asarray(background, dtype=np.float64)
    patch = base + cover[..., None] * (np.asarray(rgb, dtype=np.float64) - base)
    height, width = canvas.shape[:2]
    canvas[np.ix_(rows % height, cols % width)] = np.rint(patch).astype(np.uint8)


def _blank(frames: int, height: int, width: int) -> np.ndarray:
    video = np.empty((frames, height, width, 3), dtype=np.uint8)
    video[...] = np.asarray(BACKGROUND_RGB, dtype=np.uint8)
    return video


def render_video(scene: Scene) -> np.ndarray:
    """The clip's frames, uint8 [frames, height, width, 3]."""
    video = _blank(scene.frames, scene.height, scene.width)
    for index, (x, y) in enumerate(trajectory(scene)):
        _paint(video[index], scene.attrs.shape, scene.attrs.color, float(x), float(y), scene.size)
    return video


def reference_image(color: str, shape: str, size: int = 256) -> np.ndarray:
    """A Ref2VA reference image: the object, size / 2 across, centred on the background; uint8 [size, size, 3]."""
    if color not in COLORS or shape not in SHAPES:
        raise ValueError(f"unknown color or shape: {color!r}, {shape!r}")
    if size < 8:
        raise ValueError("reference images are at least 8 px")
    image = _blank(1, size, size)[0]
    edge = size / 2
    _paint(image, shape, color, (size - edge) / 2, (size - edge) / 2, edge)
    return image


# -- audio ------------------------------------------------------------------------------------------------------------


def audio_samples(frames: int) -> int:
    """The model's audio length for a clip of `frames` video frames (whole audio latents of 800 samples)."""
    return round(frames / FPS * AUDIO_LATENTS_PER_SECOND) * SAMPLES_PER_LATENT


def _tone(sound: str, samples: int) -> np.ndarray:
    """The sound's sine, amplitude TONE_AMPLITUDE, phase 0 at sample 0; float64 [samples]."""
    if sound not in SOUNDS:
        raise ValueError(f"unknown sound {sound!r}")
    return TONE_AMPLITUDE * np.sin(2 * np.pi * PITCH_HZ[sound] * np.arange(samples) / AUDIO_SAMPLE_RATE)


def _pan_gains(centre_x: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray]:
    """Equal-power (left, right) gains for horizontal centres, scaled so a centred object gets 1 on each side."""
    p = np.mod(centre_x / width, 1.0)
    return np.cos(p * np.pi / 2) * math.sqrt(2), np.sin(p * np.pi / 2) * math.sqrt(2)


def click_start(t: float) -> int:
    """The first sample of the click of an impact at `t` seconds: the audio latent boundary nearest it."""
    return round(t * AUDIO_LATENTS_PER_SECOND) * SAMPLES_PER_LATENT


def click_wave(start: int, samples: int = SAMPLES_PER_LATENT) -> np.ndarray:
    """The click's sine from sample `start` on (global phase), float64 [samples]; above the checks' 4 kHz click band
    and far from the tones."""
    return CLICK_AMPLITUDE * np.sin(2 * np.pi * CLICK_HZ * (start + np.arange(samples)) / AUDIO_SAMPLE_RATE)


def click_latents(scene: Scene, audio_latents: int) -> list[int]:
    """The audio latents (25 ms each, from the clip's start) that hold a click, among the first `audio_latents`."""
    until = audio_latents / AUDIO_LATENTS_PER_SECOND
    starts = (click_start(t) // SAMPLES_PER_LATENT for t in impact_times(scene, until))
    return [index for index in starts if index < audio_latents]


def _add_clicks(audio: np.ndarray, times: list[float]) -> None:
    total = audio.shape[1]
    for t in times:
        start = click_start(t)
        end = min(start + SAMPLES_PER_LATENT, total)
        if end > start:
            audio[:, start:end] += click_wave(start, end - start)


def render_audio(scene: Scene, samples: int | None = None) -> np.ndarray:
    """The clip's stereo audio at 32 kHz, float32 [2, samples]: the panned tone plus a click at each impact."""
    total = audio_samples(scene.frames) if samples is None else samples
    if total < 0:
        raise ValueError("samples must be >= 0")
    frame_times = np.arange(math.ceil(total * FPS / AUDIO_SAMPLE_RATE) + 2) / FPS
    x, _ = _positions(scene, frame_times)
    left, right = _pan_gains(x + scene.size / 2, scene.width)
    times = np.arange(total) / AUDIO_SAMPLE_RATE
    tone = _tone(scene.attrs.sound, total)
    audio = np.stack([tone * np.interp(times, frame_times, left), tone * np.interp(times, frame_times, right)])
    _add_clicks(audio, impact_times(scene, total / AUDIO_SAMPLE_RATE))
    return np.clip(audio, -1.0, 1.0).astype(np.float32)


def reference_audio(sound: str, seconds: float = 2.0) -> np.ndarray:
    """A Ref2VA reference sound: the centred tone without clicks, float32 [2, seconds * 32000]."""
    tone = _tone(sound, round(seconds * AUDIO_SAMPLE_RATE))
    return np.stack([tone, tone]).astype(np.float32)


# -- sampling ---------------------------------------------------------------------------------------------------------


def _jitter(value: float, limit: float, rng: np.random.Generator | None) -> float:
    if rng is None:
        return value
    return float(np.clip(value + rng.uniform(-START_JITTER, START_JITTER), 0.0, limit))


def canonical_start(
    motion: str, width: int = DEFAULT_WIDTH, height: int = DEFAULT_HEIGHT, rng: np.random.Generator | None = None
) -> tuple[float, float]:
    """T2VA start (x, y): the object leaves from near the edge it moves away from; jittered by +-2 px with an rng."""
    if motion not in MOTIONS:
        raise ValueError(f"unknown motion {motion!r}")
    size = object_size(height)
    x, y = (width - size) / 2, (height - size) / 2
    if motion == "moving left":
        x = width - size - HORIZONTAL_MARGIN
    elif motion == "moving right":
        x = HORIZONTAL_MARGIN
    elif motion == "moving up":
        y = height - size - VERTICAL_MARGIN
    elif motion == "moving down":
        y = VERTICAL_MARGIN
    else:
        y = 0.0
    return _jitter(x, width - size, rng), _jitter(y, height - size, rng)


def random_start(motion: str, width: int, height: int, rng: np.random.Generator) -> tuple[float, float]:
    """FL2VA/training start (x, y), uniform on the canvas (bouncing: in the upper half of the drop range)."""
    if motion not in MOTIONS:
        raise ValueError(f"unknown motion {motion!r}")
    size = object_size(height)
    y_limit = (height - size) * (0.5 if motion == "bouncing" else 1.0)
    x = float(rng.uniform(0.0, width - size))
    return x, float(rng.uniform(0.0, y_limit))


def random_attributes(rng: np.random.Generator) -> Attributes:
    """Colour, shape, motion and sound, each uniform (drawn in that order)."""
    picks = [values[int(rng.integers(len(values)))] for values in (COLORS, SHAPES, MOTIONS, SOUNDS)]
    return Attributes(*picks)


def sample_scene(
    rng: np.random.Generator,
    task: str,
    width: int = DEFAULT_WIDTH,
    height: int = DEFAULT_HEIGHT,
    frames: int = DEFAULT_FRAMES,
    attrs: Attributes | None = None,
) -> Scene:
    """A scene for `task` ("t2va": jittered canonical start, "fl2va": random start); attrs uniform when None."""
    if task not in TASKS:
        raise ValueError(f"task must be one of {TASKS}, got {task!r}")
    attrs = random_attributes(rng) if attrs is None else attrs
    if task == "t2va":
        x0, y0 = canonical_start(attrs.motion, width, height, rng)
    else:
        x0, y0 = random_start(attrs.motion, width, height, rng)
    return Scene(attrs=attrs, x0=x0, y0=y0, width=width, height=height, frames=frames)
