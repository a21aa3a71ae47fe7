"""The in-process engine: which DiTs it loads for --task-type, and refusing a task it cannot serve."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from h3serve.config.engine_config import EngineConfig
from h3serve.config_checks import check_config
from h3serve.rank.model_runner import ModelRunner
from h3serve.rules.request import GenerationRequest, MediaRef
from h3serve.rules.validate import RequestError


@pytest.fixture(scope="module")
def keyframe(tmp_path_factory):
    path = tmp_path_factory.mktemp("kf") / "first.png"
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 255, (256, 384, 3), dtype=np.uint8)).save(path)
    return MediaRef(path, "first.png")


def test_ref2va_only_engine_refuses_t2va_and_fl2va(tiny_checkpoint, keyframe):
    engine = ModelRunner(EngineConfig(model=tiny_checkpoint, task_type="ref2va"))
    assert engine.tasks == ("ref2va",)
    assert engine.pipeline.components.transformer is None and engine.pipeline.components.transformer_ref is not None
    for request in (GenerationRequest(prompt="x"), GenerationRequest(prompt="x", image=keyframe)):
        with pytest.raises(RequestError, match="is not served here: the loaded DiT serves ref2va"):
            engine.plan(request)


def test_default_engine_loads_both_dits_and_runs_fl2va(tiny_checkpoint, keyframe):
    engine = ModelRunner(EngineConfig(model=tiny_checkpoint))
    assert engine.tasks == ("t2va", "fl2va", "ref2va")
    plan = engine.plan(GenerationRequest(prompt="x", image=keyframe, steps=1, duration_s=4))
    assert (plan.task, plan.width, plan.height) == ("fl2va", 96, 64)  # the keyframe's 3:2 aspect at short edge 64
    out = engine.generate(plan)
    assert out.video.shape == (107, 64, 96, 3)
    assert {"media_load", "vision_encode", "vae_encode", "denoise"} <= set(out.stage_durations)


def test_a_long_request_the_device_cannot_hold_is_refused_before_it_runs(tiny_checkpoint, monkeypatch):
    """The server path: the engine puts a 30 s one-pass request to the planner (1.5 GiB device) before any step
    (with the full decode, which holds the whole video: streamed, the same request fits, see test_placement)."""
    config = EngineConfig(model=tiny_checkpoint, threads=1, device_memory=3 * 2**30 // 2, decode_mode="full")
    engine = ModelRunner(config)
    monkeypatch.setattr(engine.pipeline, "generate", lambda *a, **k: pytest.fail("the request ran"))
    full = engine.plan(GenerationRequest(prompt="x", width=96, height=64, duration_s=30, long_video=True))
    with pytest.raises(RequestError, match=r"long_video_mode: this server cannot run .* longest pass \(736 frames"):
        engine.generate(full)


def test_a_pinned_denoise_row_chunk_reaches_every_block_and_keeps_the_output(tiny_checkpoint):
    """--denoise-chunk-rows N runs every DiT block in chunks (here 2 of the ~500 rows); the MP4's frames and
    samples are bit-identical to whole rows. `auto` without a device size resolves to whole rows."""
    request = GenerationRequest(prompt="a lighthouse", steps=2, duration_s=4, seed=3)
    outputs = {}
    for chunk in ("auto", 256):
        engine = ModelRunner(EngineConfig(model=tiny_checkpoint, task_type="fl2va", denoise_chunk_rows=chunk))
        resolved = None if chunk == "auto" else chunk
        assert engine.config.denoise_chunk_rows == resolved
        assert {b.row_chunk for b in engine.pipeline.components.transformer.transformer_blocks} == {resolved}
        outputs[chunk] = engine.generate(engine.plan(request))
    assert np.array_equal(outputs["auto"].video, outputs[256].video)
    assert np.array_equal(outputs["auto"].audio, outputs[256].audio)


def test_a_denoise_row_chunk_below_the_floor_is_refused():
    from h3serve.entrypoints.engine_args import denoise_chunk_rows
    from h3serve.errors import ConfigError

    assert denoise_chunk_rows(None) == "auto" and denoise_chunk_rows(" OFF ") is None
    assert denoise_chunk_rows("4096") == 4096
    for bad in ("64", "many", "-1"):
        with pytest.raises(ConfigError, match="--denoise-chunk-rows"):
            denoise_chunk_rows(bad)
    with pytest.raises(ConfigError, match=r"--denoise-chunk-rows: must be >= 256"):
        check_config(EngineConfig(model=".", denoise_chunk_rows=100))
