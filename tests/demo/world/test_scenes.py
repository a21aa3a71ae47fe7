"""The demo world: prompt grammar, trajectories, wrap-around, bounces, rendering, audio length, pan and clicks."""

from __future__ import annotations

import math

import numpy as np
import pytest

from h3serve.demo.world.grammar import (
    BACKGROUND_RGB,
    COLOR_RGB,
    MOTIONS,
    Attributes,
    all_t2va_attributes,
    all_t2va_prompts,
    parse_prompt,
    prompt_for,
)
from h3serve.demo.world.scenes import (
    SAMPLES_PER_LATENT,
    Scene,
    audio_samples,
    canonical_start,
    click_latents,
    click_start,
    click_wave,
    impact_frames,
    impact_times,
    object_size,
    random_start,
    reference_audio,
    reference_image,
    render_audio,
    render_video,
    sample_scene,
    trajectory,
)
from h3serve.rules.limits import AUDIO_SAMPLE_RATE, FPS

W, H, S = 128, 64, 16
BACKGROUND = np.array(BACKGROUND_RGB, dtype=np.uint8)


def _scene(motion: str, x0: float, y0: float, frames: int = 107, **attrs: str) -> Scene:
    full = {"color": "red", "shape": "ball", "motion": motion, "sound": "low hum"} | attrs
    return Scene(Attributes(**full), x0=x0, y0=y0, frames=frames)


def _object_pixels(frame: np.ndarray) -> np.ndarray:
    return np.any(frame != BACKGROUND, axis=-1)


# -- grammar ----------------------------------------------------------------------------------------------------------


def test_all_80_prompts_in_a_fixed_order():
    prompts = all_t2va_prompts()
    assert len(prompts) == len(set(prompts)) == 80
    assert prompts[0] == "a red ball moving left, with a low hum"
    assert prompts[1] == "a red ball moving left, with a high beep"
    assert prompts[-1] == "a yellow square bouncing, with a high beep"


def test_prompts_round_trip_with_and_without_references():
    for attrs in all_t2va_attributes():
        assert parse_prompt(prompt_for(attrs)) == attrs
        image_only = Attributes(None, attrs.shape, attrs.motion, attrs.sound)
        assert parse_prompt(prompt_for(attrs, reference_image=True)) == image_only
        both = Attributes(None, attrs.shape, attrs.motion, None)
        assert parse_prompt(prompt_for(attrs, reference_image=True, reference_sound=True)) == both


def test_ref2va_prompt_forms():
    attrs = Attributes("blue", "square", "moving up", "high beep")
    assert prompt_for(attrs, reference_image=True) == "the square from the reference image moving up, with a high beep"
    assert (
        prompt_for(attrs, reference_image=True, reference_sound=True)
        == "the square from the reference image moving up, with the reference sound"
    )


@pytest.mark.parametrize(
    "text",
    [
        "a purple ball moving left, with a low hum",
        "a red triangle moving left, with a low hum",
        "a red ball moving sideways, with a low hum",
        "a red ball moving left, with a loud bang",
        "a red ball moving left",
        "a red ball moving left with a low hum",
        "a red ball moving left, with a low hum and a beep",
        "A red ball moving left, with a low hum",
        "a red ball moving left, with the reference sound",
        "the red ball from the reference image bouncing, with a low hum",
        "the ball from the reference image bouncing",
        "",
    ],
)
def test_grammar_refuses_other_text(text):
    with pytest.raises(ValueError):
        parse_prompt(text)


def test_attributes_and_prompts_refuse_what_the_grammar_lacks():
    with pytest.raises(ValueError):
        Attributes("purple", "ball", "bouncing", "low hum")
    with pytest.raises(ValueError):
        Attributes("red", "ball", "spinning", "low hum")
    with pytest.raises(ValueError):
        prompt_for(Attributes("red", "ball", "bouncing", "low hum"), reference_sound=True)
    with pytest.raises(ValueError):
        prompt_for(Attributes(None, "ball", "bouncing", "low hum"))


# -- geometry and motion ----------------------------------------------------------------------------------------------


def test_object_size_and_canonical_starts():
    assert object_size(64) == 16 and object_size(32) == 8 and object_size(128) == 32
    assert canonical_start("moving left") == (W - S - 8, (H - S) / 2)
    assert canonical_start("moving right") == (8, (H - S) / 2)
    assert canonical_start("moving up") == ((W - S) / 2, H - S - 4)
    assert canonical_start("moving down") == ((W - S) / 2, 4)
    assert canonical_start("bouncing") == ((W - S) / 2, 0)


def test_start_jitter_and_random_starts_stay_on_the_canvas():
    rng = np.random.default_rng(0)
    for motion in MOTIONS:
        x, y = canonical_start(motion)
        for _ in range(50):
            jx, jy = canonical_start(motion, W, H, rng)
            assert abs(jx - x) <= 2 and abs(jy - y) <= 2
            assert 0 <= jx <= W - S and 0 <= jy <= H - S
            rx, ry = random_start(motion, W, H, rng)
            assert 0 <= rx <= W - S and 0 <= ry <= (H - S) * (0.5 if motion == "bouncing" else 1)


@pytest.mark.parametrize(
    ("motion", "step"), [("moving left", (-1, 0)), ("moving right", (1, 0)), ("moving up", (0, -10 / 24)),
                         ("moving down", (0, 10 / 24))],
)
def test_steady_motions_move_at_their_speed(motion, step):
    x0, y0 = canonical_start(motion)
    track = trajectory(_scene(motion, x0, y0))
    assert track.shape == (107, 2)
    np.testing.assert_allclose(np.diff(track, axis=0), np.broadcast_to(step, (106, 2)), atol=1e-9)
    wide = trajectory(Scene(Attributes("red", "ball", motion, "low hum"), x0, y0, width=256, height=128))
    np.testing.assert_allclose(np.diff(wide, axis=0)[0], 2 * np.asarray(step), atol=1e-9)


def test_the_canvas_wraps():
    scene = _scene("moving right", W - S / 2, 20.0, frames=30)
    first = _object_pixels(render_video(scene)[0])
    assert first[:, 0].any() and first[:, W - 1].any() and not first[:, W // 2].any()
    assert trajectory(scene)[-1, 0] > W  # unwrapped
    # A whole canvas further along renders the same frames, horizontally and vertically.
    np.testing.assert_array_equal(render_video(scene), render_video(_scene("moving right", W * 3 - S / 2, 20.0, 30)))
    down = _scene("moving down", 30.0, H - 4.0, frames=30)
    frame = _object_pixels(render_video(down)[0])
    assert frame[0].any() and frame[H - 1].any()
    np.testing.assert_array_equal(render_video(down), render_video(_scene("moving down", 30.0, -4.0, frames=30)))


def test_bounces_from_the_top_hit_the_bottom_every_1_2_s():
    scene = _scene("bouncing", 56.0, 0.0)
    np.testing.assert_allclose(impact_times(scene, 3.1), [0.6, 1.8, 3.0], atol=1e-9)
    assert impact_frames(scene) == [14, 43, 72, 101]
    track = trajectory(scene)
    assert track[:, 1].min() == 0.0 and track[:, 1].max() <= H - S + 1e-9
    assert track[72, 1] == pytest.approx(H - S)  # t = 3.0 s exactly
    assert track[:, 0].tolist() == [56.0] * 107


def test_bounce_period_from_a_lower_start_and_resting():
    scene = _scene("bouncing", 10.0, 24.0, frames=240)
    g = 2 * (H - S) / 0.36
    period = 2 * math.sqrt(2 * (H - S - 24.0) / g)
    np.testing.assert_allclose(np.diff(impact_times(scene, 10.0)), period, atol=1e-9)
    resting = _scene("bouncing", 10.0, H - S - 0.5)
    assert impact_frames(resting) == [] and np.all(trajectory(resting)[:, 1] == H - S - 0.5)


# -- rendering --------------------------------------------------------------------------------------------------------


def test_outputs_have_the_contracted_shapes_and_types():
    scene = sample_scene(np.random.default_rng(0), "t2va")
    video, audio = render_video(scene), render_audio(scene)
    assert video.shape == (107, H, W, 3) and video.dtype == np.uint8
    assert audio.shape == (2, 142_400) and audio.dtype == np.float32
    assert np.abs(audio).max() <= 1.0
    image, tone = reference_image("green", "ball"), reference_audio("high beep")
    assert image.shape == (256, 256, 3) and image.dtype == np.uint8
    assert tone.shape == (2, 64_000) and tone.dtype == np.float32


def test_audio_length_follows_the_model():
    assert audio_samples(107) == 142_400 and audio_samples(124) == 165_600
    scene = _scene("moving left", 50.0, 20.0, frames=124)
    assert render_audio(scene).shape == (2, 165_600)
    assert render_audio(scene, samples=1000).shape == (2, 1000)


def test_everything_is_deterministic():
    scenes = [sample_scene(np.random.default_rng(7), task) for task in ("t2va", "fl2va") for _ in range(2)]
    assert scenes[0] == scenes[1] and scenes[2] == scenes[3]
    bounce = _scene("bouncing", 56.0, 0.0)
    for scene in (scenes[0], scenes[2], bounce):
        np.testing.assert_array_equal(render_video(scene), render_video(scene))
        np.testing.assert_array_equal(render_audio(scene), render_audio(scene))


def test_sample_scene_tasks_and_attributes():
    rng = np.random.default_rng(1)
    attrs = Attributes("yellow", "square", "moving up", "high beep")
    scene = sample_scene(rng, "fl2va", width=96, height=32, frames=124, attrs=attrs)
    assert (scene.attrs, scene.width, scene.height, scene.frames) == (attrs, 96, 32, 124)
    assert render_video(scene).shape == (124, 32, 96, 3)
    with pytest.raises(ValueError):
        sample_scene(rng, "ref2va")
    with pytest.raises(ValueError):
        Scene(Attributes(None, "ball", "bouncing", "low hum"), 0.0, 0.0)
    with pytest.raises(ValueError):
        Scene(attrs, 0.0, 0.0, height=31)


def test_objects_are_antialiased_and_coloured():
    ball = render_video(_scene("moving right", 20.25, 10.5, frames=1, color="blue"))[0]
    square = render_video(_scene("moving right", 20.0, 10.0, frames=1, shape="square", color="blue"))[0]
    assert tuple(ball[18, 28]) == COLOR_RGB["blue"]
    # The square fills its box exactly; the ball leaves the box's corners empty and shades its rim.
    assert _object_pixels(square).sum() == S * S
    assert tuple(ball[11, 21]) == BACKGROUND_RGB
    partial = _object_pixels(ball) & np.all(ball != np.array(COLOR_RGB["blue"]), axis=-1)
    assert partial.sum() > 10


def test_reference_image_centres_the_object():
    image = reference_image("yellow", "square", size=256)
    assert tuple(image[128, 128]) == COLOR_RGB["yellow"] and tuple(image[0, 0]) == BACKGROUND_RGB
    assert _object_pixels(image).sum() == 128 * 128 and _object_pixels(image)[64:192, 64:192].all()
    ball = reference_image("red", "ball", size=256)
    assert tuple(ball[64, 64]) == BACKGROUND_RGB and tuple(ball[128, 64]) != BACKGROUND_RGB


# -- audio ------------------------------------------------------------------------------------------------------------


def _frame_energy(audio: np.ndarray, frame: int) -> np.ndarray:
    start, end = round(frame * AUDIO_SAMPLE_RATE / FPS), round((frame + 1) * AUDIO_SAMPLE_RATE / FPS)
    return np.sum(audio[:, start:end].astype(np.float64) ** 2, axis=1)


def test_the_tone_pans_with_the_object():
    audio = render_audio(_scene("moving right", 8.0, 24.0))  # centre from x = 16 to x = 122
    left, right = _frame_energy(audio, 0)
    assert left > 4 * right
    left, right = _frame_energy(audio, 106)
    assert right > 4 * left
    centred = render_audio(_scene("moving up", (W - S) / 2, 24.0, sound="high beep"))
    np.testing.assert_allclose(centred[0], centred[1], atol=1e-6)
    assert np.abs(centred).max() == pytest.approx(0.25, abs=1e-3)
    reference = reference_audio("high beep")
    np.testing.assert_allclose(centred[:, : reference.shape[1]], reference, atol=1e-6)


def test_each_click_fills_the_audio_latent_nearest_its_impact():
    bounce_scene = _scene("bouncing", 56.0, 10.0)  # impacts off the latent grid: 0.534 s, 1.602 s, ...
    bounce = render_audio(bounce_scene).astype(np.float64)
    still = render_audio(_scene("bouncing", 56.0, H - S)).astype(np.float64)  # resting: the same tone and pan
    clicks = bounce - still
    np.testing.assert_allclose(clicks[0], clicks[1], atol=1e-6)  # clicks are centred
    expected = np.zeros(clicks.shape[1])
    times = impact_times(bounce_scene, clicks.shape[1] / AUDIO_SAMPLE_RATE)
    assert len(times) == 4
    for t in times:
        start = click_start(t)
        assert start % SAMPLES_PER_LATENT == 0 and abs(start / AUDIO_SAMPLE_RATE - t) <= 0.0125
        expected[start : start + SAMPLES_PER_LATENT] = click_wave(start)
    np.testing.assert_allclose(clicks[0], expected, atol=1e-6)
    # The latents the trainer weights (dit.CLICK_WEIGHT) are exactly those the clicks fill.
    latents = clicks.shape[1] // SAMPLES_PER_LATENT
    filled = np.abs(clicks[0, : latents * SAMPLES_PER_LATENT]).reshape(latents, -1).max(axis=1) > 0.1
    assert click_latents(bounce_scene, latents) == np.flatnonzero(filled).tolist()
    assert click_latents(bounce_scene, 60) == [i for i in click_latents(bounce_scene, latents) if i < 60]


def test_the_click_is_a_whole_latent_of_5khz_in_the_global_phase():
    wave = click_wave(0)
    assert len(wave) == SAMPLES_PER_LATENT and np.abs(wave).max() == pytest.approx(0.3, abs=1e-3)
    np.testing.assert_allclose(click_wave(7 * SAMPLES_PER_LATENT), wave, atol=1e-9)  # the same on every latent
    assert abs(wave[0]) < 1e-12 and abs(wave[-1]) < 0.3 * np.sin(2 * np.pi * 5000 / AUDIO_SAMPLE_RATE) + 1e-9
    spectrum = np.abs(np.fft.rfft(wave))
    assert np.fft.rfftfreq(len(wave), 1 / AUDIO_SAMPLE_RATE)[np.argmax(spectrum)] == 5000.0
