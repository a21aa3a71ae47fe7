"""Regional compilation under layerwise offload: the streaming hooks stay outside the compiled blocks."""

from __future__ import annotations

import argparse
import shlex

import pytest

from h3serve.entrypoints.engine_args import add_engine_args, engine_config_from_args
from h3serve.rank.model_runner import ModelRunner
from h3serve.rules.request import GenerationRequest


def _engine(checkpoint, flags: str) -> ModelRunner:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(shlex.split(f"--device cpu --threads 1 --task-type t2va {flags}"))
    return ModelRunner(engine_config_from_args(args, checkpoint))


@pytest.mark.slow
def test_compiled_blocks_with_layerwise_offload_match_eager(tiny_checkpoint):
    request = GenerationRequest(prompt="waves", steps=2, seed=2, duration_s=4)
    eager = _engine(tiny_checkpoint, "")
    compiled = _engine(tiny_checkpoint, "--enable-layerwise-offload --diffusion-compile-granularity regional")
    ref = eager.pipeline.generate(eager.plan(request))
    got = compiled.pipeline.generate(compiled.plan(request))
    for key in ("video_latents", "audio_latents"):
        assert (getattr(got, key) - getattr(ref, key)).abs().max() <= 1e-4
    assert ref.video_latents.std() > 0.1
    assert compiled.config.compile_mode(compiled.device.type) == "regional" and compiled.config.offload.streamed
