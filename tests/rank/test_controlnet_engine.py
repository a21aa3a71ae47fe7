"""A ControlNet through the engine and the CLI on the tiny checkpoint: control media decoded onto the 24 fps grid and
the canvas, encoded into the 196 columns; scale 0 is the base output bit for bit; a mask with a source (inpaint)
and a control video each change the output; the combinations the branch does not run in are refused by name."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from h3serve.config.engine_config import EngineConfig
from h3serve.config_checks import check_config
from h3serve.entrypoints.cli import main
from h3serve.errors import ConfigError
from h3serve.media.mp4 import EncoderOptions, write_mp4
from h3serve.rank.media_conditioning import control_pixels
from h3serve.rank.model_runner import ModelRunner
from h3serve.rules.request import ControlRequest, GenerationRequest, MediaRef
from h3serve.rules.validate import RequestError
from h3serve.tools.tiny.make_adapter import write_controlnet
from h3serve.tools.tiny.make_checkpoint import PRESETS

PROMPT = "a red ball moving left"


@pytest.fixture(scope="module")
def media(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("control-media")
    t = np.linspace(0, 1, 36, dtype=np.float32)[:, None, None, None]
    x = np.linspace(0, 1, 160, dtype=np.float32)[None, None, :, None]
    edges = np.broadcast_to(((x * 8 + t * 4) % 1.0 > 0.5).astype(np.float32), (36, 80, 160, 3)).copy()
    silence, fast = np.zeros((2, 48_000), np.float32), EncoderOptions(preset="ultrafast")
    write_mp4(folder / "edges.mp4", edges, silence, options=fast)
    source = np.broadcast_to(np.array([0.2, 0.4, 0.8], np.float32), (36, 80, 160, 3)).copy()
    write_mp4(folder / "source.mp4", source, silence, options=fast)
    mask = np.zeros((64, 128), np.uint8)
    mask[:, 64:] = 255  # regenerate the right half
    Image.fromarray(mask).save(folder / "mask.png")
    Image.new("RGB", (512, 256), (200, 30, 30)).save(folder / "keyframe.png")
    names = (("edges", "mp4"), ("source", "mp4"), ("mask", "png"), ("keyframe", "png"))
    return {name: folder / f"{name}.{ext}" for name, ext in names}


@pytest.fixture(scope="module")
def control_file(tmp_path_factory) -> Path:
    return write_controlnet(tmp_path_factory.mktemp("controlnet"), dict(PRESETS["tiny"].transformer), blocks=3,
                            seed=2, std=0.2)


@pytest.fixture(scope="module")
def engine(tiny_checkpoint, control_file):
    return ModelRunner(EngineConfig(model=tiny_checkpoint, threads=1, task_type="fl2va",
                                    controlnet_model_path=str(control_file)))


def _ref(path: Path, kind: str | None = None) -> MediaRef:
    return MediaRef(path, path.name, kind)


def _run(engine, control: ControlRequest | None, seed: int = 3):
    request = GenerationRequest(prompt=PROMPT, duration_s=4, steps=2, seed=seed, control=control)
    return engine.generate(engine.plan(request))


def test_control_changes_the_output_and_scale_0_is_the_base(engine, media):
    base = _run(engine, None)
    canny = ControlRequest("canny", control=_ref(media["edges"], "video"))
    steered = _run(engine, canny)
    assert np.abs(steered.video - base.video).max() > 0.05
    off = _run(engine, replace(canny, scale=0.0))
    assert np.array_equal(off.video, base.video) and np.array_equal(off.audio, base.audio)
    inpaint = ControlRequest("inpaint", source=_ref(media["source"], "video"), mask=_ref(media["mask"]))
    assert np.abs(_run(engine, inpaint).video - base.video).max() > 0.05


def test_control_media_lands_on_the_grid_and_the_canvas(engine, media):
    plan = engine.plan(GenerationRequest(prompt=PROMPT, duration_s=4, control=ControlRequest(
        "depth", control=_ref(media["edges"], "video"), source=_ref(media["source"], "video"),
        mask=_ref(media["mask"]), scale=0.5)))
    pixels = control_pixels(plan)
    assert pixels.scale == 0.5 and pixels.control.shape == (1, 3, plan.num_frames, 64, 128)
    assert pixels.mask.shape == (1, 1, plan.num_frames, 64, 128) and set(pixels.mask.unique().tolist()) == {0.0, 1.0}
    assert pixels.mask[..., :, :60].max() == 0 and pixels.mask[..., :, 68:].min() == 1  # the still mask, held
    # 36 source frames at 24 fps cover frames 0-35; the 107-frame output holds the last one after that.
    assert torch.equal(pixels.control[:, :, 40], pixels.control[:, :, -1])


def test_refusals_name_the_field_or_the_flag(tiny_checkpoint, control_file, media, engine):
    edges = _ref(media["edges"], "video")
    for control, says in (
        (ControlRequest("inpaint", control=edges), "inpaint control needs a mask"),
        (ControlRequest("canny"), "canny control needs a control video"),
        (ControlRequest("canny", control=edges, source=edges), "a source video needs a mask"),
        (ControlRequest("canny", control=edges, scale=-1.0), "finite number from 0 to 10"),
        (ControlRequest("canny", control=edges, scale=1e308), "finite number from 0 to 10"),
    ):
        with pytest.raises(RequestError, match=says):
            engine.plan(GenerationRequest(prompt=PROMPT, duration_s=4, control=control))
    with pytest.raises(RequestError, match="T2VA requests only") as e:
        engine.plan(GenerationRequest(prompt=PROMPT, duration_s=4, task="fl2va", control=ControlRequest(
            "canny", control=edges), image=_ref(media["keyframe"], "image")))
    assert e.value.field == "extra_params.canny"
    for overrides, says in (({"ulysses_degree": 2}, "--usp/--ring"), ({"cache_backend": "cache_dit"}, "--cache")):
        with pytest.raises(ConfigError, match=says):
            check_config(EngineConfig(model=tiny_checkpoint, controlnet_model_path=str(control_file), **overrides))


def test_generate_cli_with_a_control_video(tiny_checkpoint, control_file, media, tmp_path, capsys):
    common = ["generate", PROMPT, "--model", str(tiny_checkpoint), "--duration", "4", "--steps", "2", "--seed", "3",
              "--controlnet-model-path", str(control_file)]
    assert main([*common, "-o", str(tmp_path / "a.mp4"), "--control", f"canny={media['edges']}"]) == 0
    assert main([*common, "-o", str(tmp_path / "b.mp4")]) == 0
    assert main([*common, "-o", str(tmp_path / "c.mp4"), "--control", f"canny={media['edges']}",
                 "--control-scale", "0"]) == 0
    a, b, c = ((tmp_path / f"{n}.mp4").read_bytes() for n in "abc")
    assert a != b and c == b
    assert main([*common, "-o", str(tmp_path / "d.mp4"), "--control-mask", str(media["mask"])]) == 2
    assert "--control-mask needs --control" in capsys.readouterr().err


def test_the_planner_counts_the_branch(tiny_checkpoint, control_file):
    """Its weights (the input projection in fp32) and its stream and hints at the largest shape, on every stage."""
    from h3serve.adapters.header import read_header
    from h3serve.offload.placement_plan import GiB
    from h3serve.rank.placement import plan_for_engine

    plain = plan_for_engine(EngineConfig(model=tiny_checkpoint, task_type="fl2va"), 64 * GiB)
    steered = plan_for_engine(EngineConfig(model=tiny_checkpoint, task_type="fl2va",
                                           controlnet_model_path=str(control_file)), 64 * GiB)
    weights = read_header(control_file).nbytes  # the tiny file is fp32, as the CPU DiT
    grown = steered.peak_device_bytes - plain.peak_device_bytes
    assert weights < grown < weights + 4 * 2**20
