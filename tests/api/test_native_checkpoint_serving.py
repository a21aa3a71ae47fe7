"""The native FL2VA/Ref2VA tree and the modular checkpoint of the same seed serve the same bytes: T2VA, FL2VA and
Ref2VA through `h3serve generate` on one rank (raw arrays equal, MP4s byte-identical), and one Ref2VA request per
layout through a live `h3serve serve` on two tensor-parallel CPU ranks (MP4s byte-identical).

The weights load bit-identical (tests/tools/tiny/test_make_native.py) onto aligned storage
(h3serve.loading.tensors.aligned): no result depends on where a tensor sits in either layout's files."""

from __future__ import annotations

import hashlib

import httpx
import numpy as np
import pytest
from api_servers import start_live_server
from PIL import Image

from h3serve.entrypoints.cli import main

pytestmark = pytest.mark.slow
SEED, STEPS = 9, 1
PROMPT = "a lighthouse in a storm"


@pytest.fixture(scope="module")
def keyframe(tmp_path_factory):
    path = tmp_path_factory.mktemp("kf") / "kf.png"
    Image.fromarray(np.random.default_rng(3).integers(0, 255, (256, 384, 3), dtype=np.uint8)).save(path)
    return path


def _cli(root, task, keyframe, out) -> tuple[dict, bytes]:
    media = {"t2va": [], "fl2va": ["--image", str(keyframe)], "ref2va": ["--ref-image", str(keyframe)]}[task]
    argv = ["generate", PROMPT, "-o", str(out / f"{task}.mp4"), "--model", str(root), *media, "--duration", "4"]
    argv += ["--steps", str(STEPS), "--seed", str(SEED), "--save-raw", str(out / f"{task}.npz")]
    argv += ["--x264-preset", "ultrafast"]
    assert main(argv) == 0
    return dict(np.load(out / f"{task}.npz")), (out / f"{task}.mp4").read_bytes()


@pytest.mark.parametrize("task", ["t2va", "fl2va", "ref2va"])
def test_native_and_modular_trees_give_the_same_bytes(
    tiny_checkpoint, tiny_native_checkpoint, keyframe, tmp_path, task
):
    (tmp_path / "m").mkdir(), (tmp_path / "n").mkdir()
    modular, modular_mp4 = _cli(tiny_checkpoint, task, keyframe, tmp_path / "m")
    native, native_mp4 = _cli(tiny_native_checkpoint, task, keyframe, tmp_path / "n")
    assert modular.keys() == native.keys() >= {"video", "audio"}
    for key, value in modular.items():
        assert value.dtype == native[key].dtype and np.array_equal(value, native[key]), key
    assert hashlib.sha256(modular_mp4).hexdigest() == hashlib.sha256(native_mp4).hexdigest()
    assert modular["video"].std() > 1e-3 and np.abs(modular["audio"]).max() > 1e-4  # the comparison carries signal


def _served_mp4(root, data_dir, keyframe) -> bytes:
    server = start_live_server(root, data_dir, "--tensor-parallel-size", "2", "--task-type", "ref2va")
    try:
        fields = {
            "prompt": (None, PROMPT),
            "seed": (None, str(SEED)),
            "num_inference_steps": (None, str(STEPS)),
            "extra_params": (None, '{"duration": 4}'),
            "image_reference": ("kf.png", keyframe.read_bytes()),
        }
        response = httpx.post(f"{server.url}/v1/videos/sync", files=fields, timeout=600)
        assert response.status_code == 200, response.text
        return response.content
    finally:
        server.stop()


def test_live_tp2_server_serves_both_trees_the_same_bytes(tiny_checkpoint, tiny_native_checkpoint, keyframe, tmp_path):
    modular = _served_mp4(tiny_checkpoint, tmp_path / "m", keyframe)
    native = _served_mp4(tiny_native_checkpoint, tmp_path / "n", keyframe)
    assert modular[4:8] == b"ftyp" and len(modular) > 1000
    assert hashlib.sha256(modular).hexdigest() == hashlib.sha256(native).hexdigest()
