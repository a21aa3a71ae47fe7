"""A server with a fused FastH3 adapter: its pinned schedule (4 forwards at fixed positions), T2VA only, no lora."""

from __future__ import annotations

import pytest
from small_dit import SMALL_DIT

from h3serve.adapters.fasth3 import POSITIONS
from h3serve.adapters.serving import engine_defaults
from h3serve.config.engine_config import EngineConfig
from h3serve.rules.adapter_choice import AdapterChoice
from h3serve.rules.request import GenerationRequest, MediaRef
from h3serve.rules.schedule import shifted_sigmas
from h3serve.rules.validate import ModelDefaults, RequestError, validate
from h3serve.tools.tiny.make_adapter import write_fasth3_adapter


def test_the_pinned_sigmas_are_fasth3s():
    video = shifted_sigmas(POSITIONS, 12.0)
    audio = shifted_sigmas(POSITIONS, 3.0)
    assert [round(s, 5) for s in video] == [0.99992, 0.97283, 0.92308, 0.8, 0.0]
    assert [round(s, 5) for s in audio] == [0.99967, 0.89952, 0.75, 0.5, 0.0]


def test_requests_follow_the_fused_adapters_rules(tmp_path):
    path = write_fasth3_adapter(tmp_path / "fast", {**SMALL_DIT, "in_channels": 24}, rank=2)
    config = EngineConfig(model=tmp_path, dit_adapter=str(path.parent))
    defaults = engine_defaults(config, ModelDefaults())
    plan = validate(GenerationRequest(prompt="x"), defaults)
    assert (plan.steps, plan.pinned_positions, plan.flow_shift, plan.audio_flow_shift) == (4, POSITIONS, 12.0, 3.0)
    assert validate(GenerationRequest(prompt="x", steps=4), defaults).steps == 4
    image = MediaRef(tmp_path / "a.png", "a.png")
    lora = AdapterChoice("a", "a.safetensors", 1.0, 1, 4, 4.0)
    for request, field, message in (
        (GenerationRequest(prompt="x", steps=50), "steps", "the fused FastH3 adapter fasth3_dmd2_4step.safetensors "
                                                           "runs exactly 4 steps"),
        (GenerationRequest(prompt="x", image=image), "task", "serves t2va only, not fl2va"),
        (GenerationRequest(prompt="x", lora=lora), "lora", "a per-request LoRA cannot run on top of it"),
    ):
        with pytest.raises(RequestError, match=message) as err:
            validate(request, defaults)
        assert err.value.field == field
    assert engine_defaults(EngineConfig(model=tmp_path), ModelDefaults()) == ModelDefaults()
