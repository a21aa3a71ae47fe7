"""Defect 4: a reference video is normalised while it decodes: never all frames at the source resolution.

Scaled down from the issue's 4K 60 fps clip to 1280x720 at 60 fps for 4 s (240 frames: 663 MB as rgb24)."""

from __future__ import annotations

import subprocess
import tracemalloc

import numpy as np
import pytest

from h3serve.media import media_inputs as intake
from h3serve.model.conditioning import normalize_video_reference
from h3serve.rank.media_conditioning import load_conditioning
from h3serve.rules.request import GenerationRequest, MediaRef
from h3serve.rules.validate import ModelDefaults, validate

SOURCE = (1280, 720, 60, 4.0)  # width, height, fps, seconds
DEFAULTS = ModelDefaults(canvas_short_edge=64, canvas_max_pixels=64 * 128)  # the tiny checkpoint's canvas


@pytest.fixture(scope="module")
def clip(tmp_path_factory):
    width, height, fps, seconds = SOURCE
    path = tmp_path_factory.mktemp("clip") / "clip.mp4"
    subprocess.run(
        [
            "ffmpeg",
            "-hide_banner",
            "-loglevel",
            "error",
            "-y",
            "-f",
            "lavfi",
            "-i",
            f"testsrc2=size={width}x{height}:rate={fps}:duration={seconds}",
            "-c:v",
            "libx264",
            "-preset",
            "ultrafast",
            "-pix_fmt",
            "yuv420p",
            str(path),
        ],
        check=True,
    )
    return MediaRef(path=path, name="clip.mp4", kind="video")


def _plan(clip):
    return validate(GenerationRequest(prompt="x", references=(clip,), duration_s=4, steps=1), DEFAULTS)


@pytest.mark.slow
def test_streamed_normalisation_equals_the_batch_one_with_bounded_memory(clip):
    plan = _plan(clip)
    tracemalloc.start()
    try:
        streamed = load_conditioning(plan, DEFAULTS).references[0].frames
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    width, height, fps, seconds = SOURCE
    source_bytes = width * height * 3 * int(fps * seconds)
    print(
        f"FIGURE video reference {width}x{height}@{fps} {seconds:g}s: peak {peak / 2**20:.1f} MiB traced "
        f"(all frames at source resolution: {source_bytes / 2**20:.0f} MiB)"
    )
    assert peak < 32 * 2**20  # the batch path holds every source frame: 633 MiB

    media = intake.load_video(clip)  # every source frame, then the batch normalisation: the reference
    batch = normalize_video_reference(
        media.frames, media.fps, plan.num_frames, DEFAULTS.canvas_short_edge, DEFAULTS.canvas_max_pixels, None
    ).frames
    assert streamed.shape == batch.shape
    np.testing.assert_array_equal(streamed, batch)
