"""Inputs as a person makes them: still what the prompt names by the checks' own measures, off the world's format in
every way the module promises, and a drawn keyframe put on the canvas by the server's fit pins the world's frame."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from h3serve.demo.world import checks, drawn
from h3serve.demo.world import scenes as world
from h3serve.demo.world.grammar import BACKGROUND_RGB, COLOR_RGB, COLORS, SHAPES, Attributes
from h3serve.model.conditioning import prepare_keyframes
from h3serve.rules.limits import MEDIA_IMAGE_MIN_EDGE

SEEDS = range(40)  # fixed: every draw below is from default_rng(seed)


@pytest.mark.parametrize("color", COLORS)
def test_a_drawn_look_shifts_the_colour_and_the_background_but_keeps_the_name(color):
    looks = [drawn.drawn_look(np.random.default_rng(seed), color) for seed in SEEDS]
    for look in looks:
        cosines = checks.color_cosines(np.subtract(look.rgb, look.background))
        assert max(cosines, key=cosines.get) == color and cosines[color] >= drawn.MIN_SHIFTED_COSINE
        assert max(abs(a - b) for a, b in zip(look.rgb, COLOR_RGB[color], strict=True)) <= drawn.COLOR_JITTER
        low, high = drawn.BACKGROUND_LEVEL
        assert all(low <= c <= high + drawn.BACKGROUND_TINT for c in look.background)
    assert len({look.rgb for look in looks}) > 30 and len({look.background for look in looks}) > 20
    assert sum(look.background != BACKGROUND_RGB for look in looks) >= 38


def test_drawn_reference_images_vary_size_place_and_aspect_and_show_the_named_colour():
    fractions, aspects, places = [], set(), []
    for seed in SEEDS[:12]:
        color, shape = COLORS[seed % 4], SHAPES[seed // 4 % 2]
        image = drawn.drawn_reference_image(np.random.default_rng(seed), color, shape)
        height, width = image.shape[:2]
        nearest = min(drawn.REFERENCE_ASPECTS, key=lambda a: abs(a[0] / a[1] - width / height))
        assert abs(nearest[0] / nearest[1] - width / height) < 0.01
        aspects.add(nearest)
        short = min(width, height)
        assert MEDIA_IMAGE_MIN_EDGE == drawn.REFERENCE_SHORT_EDGE[0] <= short <= drawn.REFERENCE_SHORT_EDGE[1]
        # The object may cover over half of the image, where `measure_color`'s median background would be the
        # object: measured from the look the drawing was made with (the generator's first draw).
        look = drawn.drawn_look(np.random.default_rng(seed), color)
        offset = np.abs(image.astype(np.int64) - look.background).max(axis=2)
        mask = offset > checks.FOREGROUND_DISTANCE
        cosines = checks.color_cosines(image[offset == offset.max()].mean(axis=0) - look.background)
        assert max(cosines, key=cosines.get) == color
        rows, cols = np.flatnonzero(mask.any(1)), np.flatnonzero(mask.any(0))
        across = max(rows[-1] - rows[0], cols[-1] - cols[0]) + 1
        fractions.append(across / short)
        places.append(((cols[0] + cols[-1]) / 2 / width, (rows[0] + rows[-1]) / 2 / height))
    assert 0.23 <= min(fractions) < 0.35 and 0.65 < max(fractions) <= 0.77
    assert aspects == set(drawn.REFERENCE_ASPECTS)
    assert np.ptp(np.array(places), axis=0).min() > 0.3  # not always centred


def test_the_issues_hand_drawn_yellow_ball_measures_yellow():
    """Issue 53: a yellow ball drawn 0.375 across a 512² image on a (12, 12, 12) background."""
    look = drawn.Look((12, 12, 12), COLOR_RGB["yellow"])
    image = drawn.drawing(512, 512, "ball", look, 160.0, 160.0, 0.375 * 512)
    assert checks.measure_color(image[None]) == "yellow"


@pytest.mark.parametrize("frame", [0, -1])
def test_a_drawn_keyframe_on_the_canvas_pins_the_scenes_frame(frame):
    """Drawn keyframes of the scene's first or last frame, put on the 128x64 canvas by the server's fit (stretched
    when first in the request, cover-cropped when second), pass the keyframe check against the world's own frame:
    the clip the trainer targets is the one the keyframe asks for."""
    sizes = set()
    for seed in SEEDS[:12]:
        attrs = Attributes(COLORS[seed % 4], SHAPES[seed % 2], world.random_attributes(
            np.random.default_rng(seed)).motion, "low hum")
        scene = world.sample_scene(np.random.default_rng(100 + seed), "fl2va", 128, 64, 107, attrs)
        video = world.render_video(scene)
        rng = np.random.default_rng(seed)
        stretched = seed % 2 == 0
        image = drawn.drawn_keyframe(rng, scene, frame % scene.frames, stretched=stretched)
        sizes.add(image.shape[:2])
        if not stretched:
            assert image.shape[1] == 2 * image.shape[0]  # a second keyframe keeps the canvas's aspect
        images = [Image.fromarray(image)] if stretched else [Image.fromarray(video[0]), Image.fromarray(image)]
        fitted = np.asarray(prepare_keyframes(images, 128, 64)[-1])
        assert checks.check_keyframe(video, fitted, frame), seed
        assert checks.measure_color(image[None]) == attrs.color
    assert len(sizes) == 12 and min(min(size) for size in sizes) >= MEDIA_IMAGE_MIN_EDGE  # what the server takes
    assert min(h for h, _ in sizes) < 300 and max(h for h, _ in sizes) > 600


def test_a_drawn_reference_sound_is_the_named_pitch_at_another_length_level_and_phase():
    lengths, peaks, starts = set(), set(), set()
    for seed in SEEDS:
        sound = ("low hum", "high beep")[seed % 2]
        wave = drawn.drawn_reference_audio(np.random.default_rng(seed), sound)
        assert wave.shape[0] == 2 and wave.dtype == np.float32 and np.array_equal(wave[0], wave[1])
        assert 2.0 * 32000 <= wave.shape[1] <= 4.0 * 32000
        assert checks.measure_pitch(wave) == sound
        lengths.add(wave.shape[1])
        peaks.add(round(float(np.abs(wave).max()), 3))
        starts.add(round(float(wave[0, 0]), 3))
    assert len(lengths) == len(SEEDS) and min(peaks) < 0.2 < 0.3 < max(peaks) and len(starts) > 30
