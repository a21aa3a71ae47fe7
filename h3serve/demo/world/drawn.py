"""Inputs as a person makes them: reference images, keyframes and reference sounds off the world's own format.

The world makes its inputs one way: a reference image is the object half as wide as a 256² image, centred, on the
world's background (`world.reference_image`); a keyframe is a frame of the clip itself; a reference sound is the
centred tone at phase 0. A person draws and records them otherwise, and the shipped weights read them worse (issue
53: a yellow ball drawn 0.375 across a 512² image on a (12, 12, 12) background came out red in 5 of 5 seeds). So the
trainer and the evaluation also use inputs drawn here, each from an rng:
- the object a quarter to three quarters of a reference image's short edge, anywhere inside it;
- the image's size (as the server takes it: at least 256 px a side; a reference's short edge up to 1024 px, a
  keyframe up to three times that smallest size) and aspect (a reference in one of `REFERENCE_ASPECTS`; a keyframe
  the server stretches onto the canvas within ±10 % of the canvas's aspect);
- the background's shade (dark, from black to a dim grey, slightly tinted);
- the colour shifted slightly, but still the named colour by the checks' own measure (`checks.color_cosines`);
- a reference sound 2-4 s long, at another level and phase.
What each input shows is still the world's: the named colour, the shape, and for a keyframe the object where the
scene puts it on the canvas (its size the world's, scaled with the image), so the target clip is the world's own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from h3serve.demo.world import checks
from h3serve.demo.world import scenes as world
from h3serve.demo.world.grammar import COLOR_RGB, PITCH_HZ
from h3serve.rules.limits import AUDIO_SAMPLE_RATE, MEDIA_IMAGE_MIN_EDGE

OBJECT_FRACTION = (0.25, 0.75)  # the object's size over a reference image's short edge
REFERENCE_SHORT_EDGE = (MEDIA_IMAGE_MIN_EDGE, 1024)  # px
REFERENCE_ASPECTS = ((1, 1), (4, 3), (3, 4), (16, 9), (9, 16))  # width : height
KEYFRAME_SCALE = (1.0, 3.0)  # a keyframe's short edge over the smallest the server takes (MEDIA_IMAGE_MIN_EDGE)
KEYFRAME_ASPECT_SPREAD = 0.1  # a stretched keyframe's aspect: the canvas's times 1 ± this
BACKGROUND_LEVEL = (0, 24)  # the background's grey level (the world's is (12, 12, 20)) ...
BACKGROUND_TINT = 8  # ... plus up to this much more in each channel
COLOR_JITTER = 24  # each channel of the named colour moved by up to this much ...
MIN_SHIFTED_COSINE = 0.97  # ... while its direction from the background stays this close to the named colour's
SOUND_SECONDS = (2.0, 4.0)
SOUND_GAIN = (0.5, 1.6)  # times the world's tone amplitude


@dataclass(frozen=True)
class Look:
    """The colours a person draws with: the background and the object's colour (RGB, 0-255)."""

    background: tuple[int, int, int]
    rgb: tuple[int, int, int]


def _is_named(rgb: np.ndarray, background: np.ndarray, color: str) -> bool:
    cosines = checks.color_cosines(rgb - background)
    return max(cosines, key=cosines.__getitem__) == color and cosines[color] >= MIN_SHIFTED_COSINE


def drawn_look(rng: np.random.Generator, color: str) -> Look:
    """A background shade and `color` shifted slightly, still `color` by the checks' measure (drawn until it is)."""
    if color not in COLOR_RGB:
        raise ValueError(f"unknown color {color!r}")
    level = int(rng.integers(BACKGROUND_LEVEL[0], BACKGROUND_LEVEL[1] + 1))
    background = np.clip(level + rng.integers(0, BACKGROUND_TINT + 1, size=3), 0, 255)
    named = np.asarray(COLOR_RGB[color])
    while True:
        rgb = np.clip(named + rng.integers(-COLOR_JITTER, COLOR_JITTER + 1, size=3), 0, 255)
        if _is_named(rgb, background, color):
            return Look(tuple(int(v) for v in background), tuple(int(v) for v in rgb))


def drawing(width: int, height: int, shape: str, look: Look, x: float, y: float, size: float) -> np.ndarray:
    """An image [height, width, 3] uint8 of the `shape`, `size` across with its top-left corner at (x, y), in
    `look`'s colours (wrapping around the edges, as the world's canvas does)."""
    image = np.empty((height, width, 3), dtype=np.uint8)
    image[...] = np.asarray(look.background, dtype=np.uint8)
    world.paint_rgb(image, shape, look.rgb, x, y, size, look.background)
    return image


def drawn_reference_image(rng: np.random.Generator, color: str, shape: str) -> np.ndarray:
    """A Ref2VA reference image as a person draws it: uint8 [H, W, 3] (see the module's docstring)."""
    look = drawn_look(rng, color)
    short = int(rng.integers(REFERENCE_SHORT_EDGE[0], REFERENCE_SHORT_EDGE[1] + 1))
    aspect_w, aspect_h = REFERENCE_ASPECTS[int(rng.integers(len(REFERENCE_ASPECTS)))]
    width = round(short * max(1.0, aspect_w / aspect_h))
    height = round(short * max(1.0, aspect_h / aspect_w))
    size = short * float(rng.uniform(*OBJECT_FRACTION))
    x, y = float(rng.uniform(0, width - size)), float(rng.uniform(0, height - size))
    return drawing(width, height, shape, look, x, y, size)


def drawn_keyframe(rng: np.random.Generator, scene: world.Scene, frame: int, stretched: bool = True) -> np.ndarray:
    """Frame `frame` of `scene` as a person draws it: uint8 [H', W', 3], its short edge 1-3 times the smallest the
    server takes; `stretched` (the server stretches a first keyframe onto the canvas) lets its aspect differ from
    the canvas's by up to ±KEYFRAME_ASPECT_SPREAD, otherwise (a second keyframe, which the server cover-crops) it
    keeps it. The object is where the scene puts it, scaled with the image, so the server's fit puts it back where
    the scene has it."""
    look = drawn_look(rng, scene.attrs.color)
    spread = float(rng.uniform(-KEYFRAME_ASPECT_SPREAD, KEYFRAME_ASPECT_SPREAD)) if stretched else 0.0
    aspect = scene.width / scene.height * (1 + spread)
    short = MEDIA_IMAGE_MIN_EDGE * float(rng.uniform(*KEYFRAME_SCALE))
    height = math.ceil(short / min(aspect, 1.0))
    width = round(height * aspect) if stretched else round(height * scene.width / scene.height)
    x, y = world.trajectory(scene)[frame]
    scale_x, scale_y = width / scene.width, height / scene.height
    size = scene.size * scale_y
    centre_x, centre_y = (x + scene.size / 2) * scale_x, (y + scene.size / 2) * scale_y
    return drawing(width, height, scene.attrs.shape, look, centre_x - size / 2, centre_y - size / 2, size)


def drawn_reference_audio(rng: np.random.Generator, sound: str) -> np.ndarray:
    """A Ref2VA reference sound as a person records it: the tone, 2-4 s, at another level and a random phase,
    float32 [2, N] at 32 kHz."""
    if sound not in PITCH_HZ:
        raise ValueError(f"unknown sound {sound!r}")
    samples = round(float(rng.uniform(*SOUND_SECONDS)) * AUDIO_SAMPLE_RATE)
    amplitude = world.TONE_AMPLITUDE * float(rng.uniform(*SOUND_GAIN))
    phase = float(rng.uniform(0, 2 * math.pi))
    tone = amplitude * np.sin(2 * np.pi * PITCH_HZ[sound] * np.arange(samples) / AUDIO_SAMPLE_RATE + phase)
    return np.stack([tone, tone]).astype(np.float32)
