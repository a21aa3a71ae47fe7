"""The native FL2VA/Ref2VA tree and the modular checkpoint of the same seed: T2VA, FL2VA and Ref2VA through
`h3serve generate` on one rank give the same raw arrays to float32 round-off (the weights are bit-identical,
tests/tools/test_tiny_native.py). Not yet byte-identical: a round-off difference in the audio remains
unexplained (docs/checkpoints.md)."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from h3serve.cli import main

pytestmark = pytest.mark.slow
SEED, STEPS = 9, 2


@pytest.fixture(scope="module")
def keyframe(tmp_path_factory):
    path = tmp_path_factory.mktemp("kf") / "kf.png"
    Image.fromarray(np.random.default_rng(3).integers(0, 255, (256, 384, 3), dtype=np.uint8)).save(path)
    return path


def _cli(root, task, keyframe, out):
    media = {"t2va": [], "fl2va": ["--image", str(keyframe)], "ref2va": ["--ref-image", str(keyframe)]}[task]
    argv = ["generate", "a lighthouse in a storm", "-o", str(out / f"{task}.mp4"), "--model", str(root), *media]
    argv += ["--duration", "4", "--steps", str(STEPS), "--seed", str(SEED), "--save-raw", str(out / f"{task}.npz")]
    assert main(argv) == 0
    return dict(np.load(out / f"{task}.npz"))


@pytest.mark.parametrize("task", ["t2va", "fl2va", "ref2va"])
def test_native_and_modular_trees_give_the_same_arrays(tiny_checkpoint, tiny_native_checkpoint, keyframe, tmp_path,
                                                       task):
    (tmp_path / "m").mkdir(), (tmp_path / "n").mkdir()
    modular = _cli(tiny_checkpoint, task, keyframe, tmp_path / "m")
    native = _cli(tiny_native_checkpoint, task, keyframe, tmp_path / "n")
    assert modular.keys() == native.keys()
    # measured 2026-12-01: video bit-identical in value to 1e-6, audio within 1.7e-5 (BigVGAN amplifies round-off)
    for key, limit in (("video", 1e-5), ("audio", 1e-4)):
        assert modular[key].shape == native[key].shape
        assert np.abs(modular[key] - native[key]).max() <= limit, key
    assert modular["video"].std() > 1e-3  # the comparison carries signal
