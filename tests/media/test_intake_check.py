"""`check_references`: the same rules as `load_references`, without keeping decoded video frames."""

from __future__ import annotations

import subprocess

import numpy as np
import pytest

from h3serve.media import media_inputs as intake
from h3serve.rules.request import MediaRef


def _clip(path, seconds: float) -> MediaRef:
    subprocess.run(
        ["ffmpeg", "-v", "error", "-f", "lavfi", "-i", f"testsrc2=size=256x256:rate=8:duration={seconds}",
         "-c:v", "libx264", "-pix_fmt", "yuv420p", str(path)],
        check=True,
    )  # fmt: skip
    return MediaRef(path, path.name)


@pytest.fixture(scope="module")
def clips(tmp_path_factory):
    d = tmp_path_factory.mktemp("clips")
    return _clip(d / "a.mp4", 8), _clip(d / "b.mp4", 8)


def test_check_keeps_no_frames_but_sees_the_shape(clips):
    media = intake.load_references([clips[0]], keep_frames=False)[0]
    assert media.frames.shape == (64, 256, 256, 3)  # 8 s at 8 fps
    assert media.frames.strides[:3] == (0, 0, 0)  # a broadcast view: nothing was kept
    loaded = intake.load_references([clips[0]])[0]
    assert loaded.frames.shape == media.frames.shape and loaded.frames.strides[0] > 0
    assert np.any(loaded.frames)


def test_check_applies_the_set_rules(clips):
    intake.check_references([clips[0]])
    with pytest.raises(intake.ReferenceSetError, match="add up to 16.00 s"):
        intake.check_references(list(clips))  # 16 s of video in total
