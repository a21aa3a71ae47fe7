"""Every offload mode on one rank: outputs byte-identical to the resident run (raw arrays and MP4s), and each
stage finds only its own components on the device (the accounting hook)."""

from __future__ import annotations

import argparse
import shlex
import subprocess

import numpy as np
import pytest
import torch
from PIL import Image

from h3serve.entrypoints.engine_args import add_engine_args, engine_config_from_args
from h3serve.errors import ConfigError
from h3serve.media.mp4 import write_mp4
from h3serve.offload.activations import RequestShape
from h3serve.offload.placement_plan import stages_for
from h3serve.offload.runtime import placement_mismatches
from h3serve.rank.model_runner import ModelRunner
from h3serve.rank.placement import plan_for_engine
from h3serve.rules.request import GenerationRequest, MediaRef

MODES = {
    "none": "",
    "cpu": "--enable-cpu-offload",
    "layerwise": "--enable-layerwise-offload",
    "module_compact": """--diffusion-offload-config '{"mode": "module", "components": ["dit", "text_encoder"]}'""",
    "layer_compact": """--diffusion-offload-config '{"mode": "layer", "components": ["dit", "text_encoder", "vae"]}'""",
    "dlo_resident_1": "--enable-distributed-layerwise-offload --dlo-no-use-allgather --dlo-resident-layers 1",
    # The DiT resident, its AdaLN projections in host memory (the layerwise modes above imply the same).
    "adaln_host": """--diffusion-offload-config '{"mode": "module", "components": ["adaln", "text_encoder"]}'""",
}
ONE_TASK = ("none", "adaln_host")  # modes that check T2VA only (the others cover every task)


def engine_for(checkpoint, flags: str) -> ModelRunner:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(shlex.split(f"--device cpu --threads 1 {flags}"))
    return ModelRunner(engine_config_from_args(args, checkpoint))


@pytest.fixture(scope="module")
def requests(tmp_path_factory):
    d = tmp_path_factory.mktemp("offload-media")
    y, x = np.mgrid[0:256, 0:512]
    Image.fromarray(np.stack([x % 256, y % 256, (x + y) % 256], -1).astype(np.uint8)).save(d / "frame.png")
    subprocess.run(
        ["ffmpeg", "-v", "error", "-f", "lavfi", "-i", "sine=frequency=440:sample_rate=32000", "-t", "2.5",
         str(d / "tone.wav")],
        check=True,
    )  # fmt: skip
    image, tone = MediaRef(d / "frame.png", "frame.png"), MediaRef(d / "tone.wav", "tone.wav")
    common = {"prompt": "a lighthouse at dusk", "steps": 2, "seed": 7, "duration_s": 4}
    return {
        "t2va": GenerationRequest(**common),
        "fl2va": GenerationRequest(**common, image=image),
        "ref2va": GenerationRequest(**common, references=(image, tone)),
    }


@pytest.fixture(scope="module")
def baseline(tiny_checkpoint, requests):
    engine = engine_for(tiny_checkpoint, "")
    return {task: engine.generate(engine.plan(request)) for task, request in requests.items()}


def test_a_placement_that_differs_from_the_plan_is_reported(tiny_checkpoint, requests):
    engine = engine_for(tiny_checkpoint, MODES["cpu"])
    plan = engine.plan(requests["t2va"])
    engine.generate(plan)
    resident = plan_for_engine(engine.config.__class__(model=tiny_checkpoint), None).ranks[0]  # no offload planned
    problems = placement_mismatches(engine.offload.log, resident, stages_for("t2va"))
    assert any(p.startswith("text_encode/transformer: 0 B resident") for p in problems), problems


@pytest.mark.parametrize("mode", MODES)
def test_every_mode_is_byte_identical_and_places_each_stage(tiny_checkpoint, requests, baseline, mode, tmp_path):
    engine = engine_for(tiny_checkpoint, MODES[mode])
    for task, request in requests.items():
        if mode in ONE_TASK and task != "t2va":  # the baseline's own config: one task shows its placement
            continue
        plan = engine.plan(request)
        out = engine.generate(plan)
        ref = baseline[task]
        assert out.video.tobytes() == ref.video.tobytes(), f"{mode} {task}: video differs"
        assert out.audio.tobytes() == ref.audio.tobytes(), f"{mode} {task}: audio differs"
        check_placement(engine, task, plan)
        if task == "t2va":
            write_mp4(tmp_path / "offload.mp4", out.video, out.audio)
            write_mp4(tmp_path / "resident.mp4", ref.video, ref.audio)
            assert (tmp_path / "offload.mp4").read_bytes() == (tmp_path / "resident.mp4").read_bytes()


def check_placement(engine: ModelRunner, task: str, plan) -> None:
    """What the hooks did, stage by stage, against the placement plan and against what the mode says."""
    runtime, offload = engine.offload, engine.config.offload
    shape = RequestShape(plan.width, plan.height, plan.num_frames, task)
    planned = plan_for_engine(engine.config, None, shape).ranks[0]
    assert placement_mismatches(runtime.log, planned, stages_for(task)) == []
    staged = offload.staged_components()
    stages = ("text_encode", "denoise", "video_decode", "audio_decode") + (("vae_encode",) if task != "t2va" else ())
    assert set(runtime.log.peaks) == set(stages)
    dit = "transformer_ref" if task == "ref2va" else "transformer"
    needs = {
        "text_encode": {"text_encoder"},
        "vae_encode": {"vae"} | ({"audio_vae"} if task == "ref2va" else set()),
        "denoise": {dit},
        "video_decode": {"vae"},
        "audio_decode": {"audio_vae"},
    }
    for stage in stages:
        for component in staged:
            on_device = runtime.log.peak(stage, component, "resident")
            assert (on_device > 0) == (component in needs[stage]), f"{component} during {stage}: {on_device} B"
        for component in offload.streamed_components():
            streaming = runtime.log.peak(stage, component, "stream")
            runs_here = component in needs[stage] or (component == "text_encoder" and stage == "text_encode")
            assert (streaming > 0) == runs_here, f"{component} streamed during {stage}: {streaming} B"


def test_a_released_component_fails_loudly_instead_of_computing(tiny_checkpoint, requests):
    engine = engine_for(tiny_checkpoint, MODES["cpu"])
    engine.generate(engine.plan(requests["t2va"]))  # leaves every staged component released
    components = engine.pipeline.components
    with pytest.raises(RuntimeError):
        components.vae.post_quant_conv(torch.zeros(1, 24, 1, 2, 2))
    with pytest.raises(RuntimeError):
        components.transformer.audio_proj_in(torch.zeros(1, 32))
    assert all(p.numel() == 0 for p in components.transformer.parameters())


def test_resident_layers_stay_for_the_denoise_stage_only(tiny_checkpoint, requests):
    engine = engine_for(tiny_checkpoint, MODES["dlo_resident_1"])
    engine.generate(engine.plan(requests["t2va"]))
    log, block = engine.offload.log, engine.offload.prefix[0].nbytes  # every DiT block has the same size
    assert len(engine.offload.prefix) == 1 and block > 0
    assert log.peak("denoise", "transformer", "resident") - log.peak("text_encode", "transformer", "resident") == block
    assert log.peak("video_decode", "transformer", "resident") == log.peak("text_encode", "transformer", "resident")
    assert log.peak("denoise", "transformer", "stream") == 2 * block  # double buffering: two slots


@pytest.mark.parametrize(
    "flags, message",
    [
        ("--enable-distributed-layerwise-offload --dlo-resident-layers 2",
         "resident layers require the DiT DLO transfer to be rank-local.*--dlo-no-use-allgather"),
        ("--enable-distributed-layerwise-offload --dlo-no-use-allgather --dlo-resident-layers 5",
         "leaves only one streaming block of 6; use at most 4, or 6"),
        ("--enable-distributed-layerwise-offload --dlo-no-use-allgather --dlo-resident-layers 7",
         "the DiT has only 6 blocks"),
        ("--enable-layerwise-offload --diffusion-offload-config '{\"mode\": \"layer\"}'",
         "cannot be combined with legacy offload option.*--enable-layerwise-offload"),
        ("--enable-cpu-offload --enable-layerwise-offload", "alternatives; choose one offload mode"),
        ("--dlo-resident-layers 2", "add --enable-distributed-layerwise-offload"),
        ("--diffusion-offload-config '{\"mode\": \"layer\", \"components\": [\"unet\"]}'",
         "unknown components unet; choose from: dit, text_encoder, vae, audio_vae"),
        ("--diffusion-offload-config '{\"mode\": \"layer\", \"components\": [\"dit\", \"text_encoder\"], "
         "\"weight_transfer\": \"allgather\"}'", "text encoder cannot use weight_transfer allgather"),
        ("--diffusion-offload-config '{\"mode\": \"swap\"}'", "mode must be one of: module, layer"),
        ("--diffusion-offload-config '{\"mode\": \"layer\", \"shards\": 2}'", "unknown keys shards"),
        ("--diffusion-offload-config '[1]'", "expected a JSON object"),
        ("--dlo-resident-layers -1 --enable-distributed-layerwise-offload --dlo-no-use-allgather", "must be >= 0"),
        ("--device-memory lots", "--device-memory: expected a size such as 32GiB"),
        ("--adaln-memo off --diffusion-offload-config '{\"mode\": \"module\", \"components\": [\"adaln\"]}'",
         "needs the AdaLN memo.*drop --adaln-memo off"),
        ("--adaln-memo lots", "--adaln-memo: expected a size such as 32GiB.*or 'off'"),
        ("--adaln-memo off --adaln-cache-dir /tmp/x", "--adaln-cache-dir fills the AdaLN memo"),
    ],
)  # fmt: skip
def test_offload_refusals_name_the_fix(tiny_checkpoint, flags, message):
    with pytest.raises(ConfigError, match=message):
        engine_for(tiny_checkpoint, flags)
