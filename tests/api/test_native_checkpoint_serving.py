"""The native FL2VA/Ref2VA tree and the modular checkpoint of the same seed serve the same bytes: T2VA, FL2VA and
Ref2VA through `h3serve generate` on one rank, and through a live `h3serve serve` on tensor parallel 2."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
from api_servers import start_live_server
from PIL import Image

from h3serve.cli import main

pytestmark = pytest.mark.slow
KEY = "native-key"
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
    return (out / f"{task}.mp4").read_bytes(), dict(np.load(out / f"{task}.npz"))


def _served(root, keyframe, data_dir) -> dict[str, bytes]:
    server = start_live_server(root, data_dir, "--api-key", KEY, "--tensor-parallel-size", "2", "--device", "cpu")
    out = {}
    try:
        for task in ("t2va", "fl2va", "ref2va"):
            fields = {"prompt": "a lighthouse in a storm", "num_inference_steps": str(STEPS), "seed": str(SEED),
                      "extra_params": f'{{"task": "{task}", "duration": 4}}'}
            files = [(k, (None, v)) for k, v in fields.items()]
            if task != "t2va":
                name = "input_reference" if task == "fl2va" else "input_references"
                files.append((name, ("kf.png", keyframe.read_bytes(), "image/png")))
            response = httpx.post(f"{server.url}/v1/videos/sync", files=files,
                                  headers={"Authorization": f"Bearer {KEY}"}, timeout=600)
            assert response.status_code == 200, response.text
            out[task] = response.content
    finally:
        server.stop()
    return out


def test_native_and_modular_trees_give_the_same_bytes(tiny_checkpoint, tiny_native_checkpoint, keyframe, tmp_path):
    for task in ("t2va", "fl2va", "ref2va"):
        (tmp_path / "m").mkdir(exist_ok=True), (tmp_path / "n").mkdir(exist_ok=True)
        modular_mp4, modular_raw = _cli(tiny_checkpoint, task, keyframe, tmp_path / "m")
        native_mp4, native_raw = _cli(tiny_native_checkpoint, task, keyframe, tmp_path / "n")
        assert native_mp4 == modular_mp4, task
        assert modular_raw.keys() == native_raw.keys()
        assert all(np.array_equal(modular_raw[k], native_raw[k]) for k in modular_raw), task
        assert modular_raw["video"].std() > 1e-3  # the comparison carries signal
    modular = _served(tiny_checkpoint, keyframe, tmp_path / "served-m")
    native = _served(tiny_native_checkpoint, keyframe, tmp_path / "served-n")
    for task in ("t2va", "fl2va", "ref2va"):
        assert len(native[task]) > 1000 and native[task] == modular[task], task
