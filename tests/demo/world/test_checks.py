"""The demo-world checks pass on ground truth (clean, and blurred plus noisy) and fail on wrong content."""

from __future__ import annotations

import functools
import itertools
import math

import numpy as np
import pytest

from h3serve.demo.world.checks import (
    Verdict,
    centroids,
    check_keyframe,
    check_t2va,
    click_frames,
    clicks_match,
    foreground,
    measure_color,
    measure_motion,
    measure_pitch,
    pan_follows,
    psnr,
    rebound_frames,
    verdict_t2va,
)
from h3serve.demo.world.grammar import COLORS, MOTIONS, SHAPES, SOUNDS, Attributes
from h3serve.demo.world.scenes import (
    Scene,
    canonical_start,
    impact_frames,
    reference_audio,
    render_audio,
    render_video,
    sample_scene,
    trajectory,
)
from h3serve.rules.limits import AUDIO_SAMPLE_RATE, FPS

# Every motion x colour x sound; the shape and the task (jittered canonical or random start) vary so that each
# motion meets every shape x task pair.
COMBOS = [
    (Attributes(COLORS[c], SHAPES[(c + s) % 2], MOTIONS[m], SOUNDS[s]), ("t2va", "fl2va")[(c // 2 + s + m) % 2])
    for m, c, s in itertools.product(range(len(MOTIONS)), range(len(COLORS)), range(len(SOUNDS)))
]


def _name(attrs: Attributes) -> str:
    return "-".join(str(value).replace(" ", "_") for value in (attrs.color, attrs.shape, attrs.motion, attrs.sound))


@functools.cache
def _clip(attrs: Attributes, task: str, seed: int = 0, frames: int = 107) -> tuple[Scene, np.ndarray, np.ndarray]:
    scene = sample_scene(np.random.default_rng(seed), task, frames=frames, attrs=attrs)
    return scene, render_video(scene), render_audio(scene)


def _canonical(motion: str, **attrs: str) -> tuple[Scene, np.ndarray, np.ndarray]:
    full = {"color": "red", "shape": "ball", "motion": motion, "sound": "high beep"} | attrs
    return _clip(Attributes(**full), "t2va")


def _degrade(video: np.ndarray, audio: np.ndarray, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """A 3x3 box blur per frame, then Gaussian noise: std 8 levels on video, 0.02 on audio."""
    rng = np.random.default_rng(seed)
    padded = np.pad(video.astype(np.float32), ((0, 0), (1, 1), (1, 1), (0, 0)), mode="edge")
    height, width = video.shape[1:3]
    blurred = sum(padded[:, i : i + height, j : j + width] for i in range(3) for j in range(3)) / 9
    noisy = blurred + rng.normal(0.0, 8.0, video.shape).astype(np.float32)
    return np.clip(np.rint(noisy), 0, 255).astype(np.uint8), audio + rng.normal(0.0, 0.02, audio.shape)


def _expected_keys(attrs: Attributes) -> set[str]:
    keys = {"color", "motion", "pitch"}
    if attrs.motion in ("moving left", "moving right"):
        keys.add("pan")
    if attrs.motion == "bouncing":
        keys |= {"rebounds", "clicks"}
    return keys


# -- ground truth passes ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("attrs", "task"), COMBOS, ids=[_name(attrs) for attrs, _ in COMBOS])
def test_ground_truth_passes_every_check(attrs, task):
    _, video, audio = _clip(attrs, task)
    checks = check_t2va(video, audio, attrs)
    assert set(checks) == _expected_keys(attrs)
    assert all(checks.values()), checks


@pytest.mark.parametrize("index", range(0, len(COMBOS), 3))
def test_blurred_and_noisy_ground_truth_still_passes(index):
    attrs, task = COMBOS[index]
    _, video, audio = _clip(attrs, task, seed=index, frames=124)
    video, audio = _degrade(video, audio, seed=index)
    verdict = verdict_t2va(video, audio, attrs)
    assert verdict.passed, verdict.failed


def test_measurements_agree_with_the_scene():
    scene, video, audio = _canonical("bouncing")
    assert rebound_frames(video) == impact_frames(scene) == [14, 43, 72, 101]
    assert click_frames(audio) == impact_frames(scene)
    expected = trajectory(scene) + scene.size / 2
    np.testing.assert_allclose(centroids(video), expected, atol=0.1)
    assert foreground(video).sum(axis=(1, 2)).min() > 0.7 * math.pi * 64


def test_centroids_follow_an_object_across_the_edge():
    scene = Scene(Attributes("green", "square", "moving left", "low hum"), x0=4.0, y0=20.0, frames=24)
    found = centroids(render_video(scene))
    expected = np.mod(trajectory(scene)[:, 0] + scene.size / 2, scene.width)
    offset = np.mod(found[:, 0] - expected + scene.width / 2, scene.width) - scene.width / 2
    assert np.abs(offset).max() < 0.1
    assert measure_motion(render_video(scene)) == "moving left"


# -- wrong content fails ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("color", COLORS)
def test_a_colour_is_not_another(color):
    _, video, audio = _canonical("moving up", color=color)
    assert measure_color(video) == color
    for other in set(COLORS) - {color}:
        checks = check_t2va(video, audio, Attributes(other, "ball", "moving up", "high beep"))
        assert checks["color"] is False and checks["motion"] and checks["pitch"]


@pytest.mark.parametrize(
    ("motion", "flip", "seen"),
    [
        ("moving left", 2, "moving right"),
        ("moving right", 2, "moving left"),
        ("moving up", 1, "moving down"),
        ("moving down", 1, "moving up"),
        ("bouncing", 1, None),  # upside down: it rebounds off the top, which is no motion of the grammar
    ],
)
def test_mirrored_video_fails_the_direction(motion, flip, seen):
    _, video, audio = _canonical(motion)
    mirrored = np.flip(video, axis=flip)
    assert measure_motion(mirrored) == seen
    assert check_t2va(mirrored, audio, Attributes("red", "ball", motion, "high beep"))["motion"] is False


def test_time_reversed_video_fails_the_direction():
    _, video, _ = _canonical("moving right")
    assert measure_motion(video[::-1]) == "moving left"


@pytest.mark.parametrize("motion", ["moving left", "moving right"])
def test_swapped_stereo_fails_the_pan(motion):
    scene, video, audio = _canonical(motion)
    assert pan_follows(video, audio) > 0.9
    assert pan_follows(video, audio[::-1]) < -0.9
    assert check_t2va(video, audio[::-1], scene.attrs)["pan"] is False


def test_pan_is_undefined_without_sideways_motion():
    _, video, audio = _canonical("moving up")
    assert math.isnan(pan_follows(video, audio))


def test_bouncing_without_clicks_or_with_late_clicks_fails():
    scene, video, audio = _canonical("bouncing")
    tone_only = reference_audio("high beep", seconds=audio.shape[1] / AUDIO_SAMPLE_RATE)
    assert click_frames(tone_only) == []
    checks = check_t2va(video, tone_only, scene.attrs)
    assert checks["rebounds"] and checks["pitch"] and checks["clicks"] is False
    late = np.roll(audio, 4 * AUDIO_SAMPLE_RATE // FPS, axis=1)  # four frames late
    assert check_t2va(video, late, scene.attrs)["clicks"] is False
    slightly_late = np.roll(audio, 2 * AUDIO_SAMPLE_RATE // FPS, axis=1)
    assert check_t2va(video, slightly_late, scene.attrs)["clicks"]


def test_a_ball_that_does_not_bounce_fails():
    _, video, audio = _canonical("moving down")
    checks = check_t2va(video, audio, Attributes("red", "ball", "bouncing", "high beep"))
    assert checks["motion"] is False and checks["rebounds"] is False and checks["clicks"] is False


def test_the_wrong_tone_fails_the_pitch():
    _, video, audio = _canonical("moving up", sound="low hum")
    assert measure_pitch(audio) == "low hum"
    assert check_t2va(video, audio, Attributes("red", "ball", "moving up", "high beep"))["pitch"] is False
    t = np.arange(32_000) / AUDIO_SAMPLE_RATE
    middle = np.stack([0.25 * np.sin(2 * np.pi * 800 * t)] * 2)
    assert measure_pitch(middle) is None and measure_pitch(np.zeros((2, 32_000))) is None


def test_still_and_empty_videos_fail():
    scene, video, audio = _canonical("moving right")
    still = np.repeat(video[:1], len(video), axis=0)
    assert measure_motion(still) is None
    empty = np.zeros_like(video) + np.array([12, 12, 20], dtype=np.uint8)
    assert measure_color(empty) is None and measure_motion(empty) is None and rebound_frames(empty) == []
    assert np.isnan(centroids(empty)).all()
    verdict = Verdict(check_t2va(empty, audio, scene.attrs))
    assert not verdict.passed and set(verdict.failed) == {"color", "motion", "pan"}


def test_clicks_match_needs_a_click_near_every_rebound():
    assert clicks_match([14, 43], [15, 41])
    assert not clicks_match([14, 43], [14, 46])
    assert not clicks_match([14], [])
    assert clicks_match([], [3])


# -- keyframes --------------------------------------------------------------------------------------------------------


def test_psnr():
    a = np.zeros((8, 8, 3), dtype=np.uint8)
    b = a.copy()
    assert psnr(a, b) == math.inf
    b[0, 0, 0] = 255
    assert psnr(a, b) == pytest.approx(10 * math.log10(192))
    with pytest.raises(ValueError):
        psnr(a, b[:4])


def test_keyframe_check():
    attrs = Attributes("blue", "ball", "moving left", "low hum")
    x0, y0 = canonical_start("moving left")
    scene = Scene(attrs, x0, y0)
    video = render_video(scene)
    assert check_keyframe(video, video[0])
    noisy, _ = _degrade(video[:1], np.zeros((2, 1)), seed=3)
    assert check_keyframe(video, noisy[0])
    background = np.zeros_like(video[0]) + np.array([12, 12, 20], dtype=np.uint8)
    assert not check_keyframe(video, background)  # PSNR alone says 22.7 dB
    assert not check_keyframe(background[None], video[0])
    moved = render_video(Scene(attrs, x0 - 40, y0 + 10, frames=1))[0]
    assert not check_keyframe(video, moved)
    recoloured = render_video(Scene(Attributes("yellow", "square", "moving left", "low hum"), x0, y0, frames=1))[0]
    assert not check_keyframe(video, recoloured)  # PSNR alone says 20.2 dB
