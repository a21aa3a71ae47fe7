"""--quantization / --diffusion-quantization-config: parsing, the default quantised and kept module sets, and the
refusals (unknown component names, an exclude pattern that matches nothing, a kernel path the device lacks)."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from h3serve.accel.quant_checks import dit_linear_names, text_linear_names
from h3serve.config.engine_config import EngineConfig
from h3serve.config.quantization_config import ComponentQuant, QuantizationError, parse_quantization
from h3serve.config_checks import check_config
from h3serve.entrypoints.engine_args import add_engine_args, engine_config_from_args
from h3serve.errors import ConfigError
from h3serve.rank.device_checks import check_engine


def test_fp8_alone_quantises_every_component_per_channel():
    config = parse_quantization("fp8", None)
    assert [name for name, _ in config.components] == ["transformer", "transformer_ref", "text_encoder"]
    assert all(q == ComponentQuant() and q.per_channel for _, q in config.components)
    assert parse_quantization(None, None) is None


def test_json_selects_components_granularity_and_kernel():
    text = {"granularity": "per_tensor", "kernel": "weight_only", "dit_ref": False,
            "text_encoder": {"granularity": "per_channel"}, "dit": {"adaln": True, "exclude": ["context_embedder"]}}
    config = parse_quantization(None, json.dumps({"method": "fp8", **text}))
    assert config.kernel == "weight_only" and config.component("transformer_ref") is None
    assert config.component("transformer") == ComponentQuant("per_tensor", ("context_embedder",), True)
    assert config.component("text_encoder").per_channel


@pytest.mark.parametrize(
    ("method", "text", "message"),
    [
        ("fp8", '{"dit_refiner": true}', r"unknown keys \['dit_refiner'\]; choose from: .*components: dit, dit_ref"),
        ("fp8", '{"dit": {"scales": 1}}', r"unknown keys \['scales'\] in dit; choose from: granularity, exclude"),
        ("fp8", '{"text_encoder": {"adaln": true}}', r"unknown keys \['adaln'\] in text_encoder"),
        ("fp8", '{"granularity": "per_block"}', "granularity 'per_block'; choose from: per_channel, per_tensor"),
        ("fp8", '{"kernel": "marlin"}', "kernel 'marlin'; choose from: auto, weight_only, fp8_gemm"),
        ("int8", None, "--quantization 'int8'; choose from: fp8"),
        (None, '{"dit": true}', "needs a method: add --quantization fp8"),
        ("fp8", '{"dit": {"exclude": "x"}}', "dit.exclude must be a list of name patterns"),
        ("fp8", "[1]", "expected a JSON object, got list"),
    ],
)
def test_bad_configs_are_refused_with_the_reason(method, text, message):
    with pytest.raises(QuantizationError, match=message):
        parse_quantization(method, text)


def test_default_dit_sets(tiny_checkpoint):
    names = dit_linear_names(tiny_checkpoint / "transformer")
    q = ComponentQuant()
    chosen = {n for n in names if q.selects("transformer", n)}
    per_block = {"attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "ff.net.0.proj", "ff.net.2"}
    blocks = {n.rsplit(".", 2)[0] for n in names if n.startswith("transformer_blocks.") and n.endswith("to_q")}
    refiners = {n.rsplit(".", 2)[0] for n in names if n.startswith("token_refiner.") and n.endswith("to_q")}
    expected = {"context_embedder"} | {f"{b}.{p}" for b in blocks | refiners for p in per_block}
    assert chosen == expected
    kept = set(names) - chosen
    assert {"proj_in", "audio_proj_in", "time_embedder.linear_1", "time_embedder.linear_2", "norm_out.linear",
            "proj_out", "audio_proj_out"} <= kept
    assert all(n.endswith("adaln_proj.linear") for n in kept if n.startswith("transformer_blocks."))
    with_adaln = {n for n in names if ComponentQuant(adaln=True).selects("transformer", n)}
    assert with_adaln - chosen == {n for n in names if n.endswith("adaln_proj.linear")} | {"norm_out.linear"}


def test_default_text_encoder_set_excludes_the_vision_tower(tiny_checkpoint):
    names = text_linear_names(tiny_checkpoint / "text_encoder")
    chosen = [n for n in names if ComponentQuant().selects("text_encoder", n)]
    assert chosen and all(n.startswith("language_model.layers.") for n in chosen)
    assert len(chosen) == 7 * len({n.split(".")[2] for n in chosen})  # q k v o gate up down per layer
    assert any(n.startswith("visual.") for n in names)


def _args(*flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    add_engine_args(parser)
    return parser.parse_args(list(flags))


def test_engine_flags_build_the_config_and_refuse_at_start_up(tiny_checkpoint):
    config = engine_config_from_args(_args(str(tiny_checkpoint), "--quantization", "fp8", "--device", "cpu"))
    assert config.quantization == parse_quantization("fp8", None)
    with pytest.raises(ConfigError, match=r"unknown keys \['vae'\]"):
        engine_config_from_args(_args(str(tiny_checkpoint), "--quantization", "fp8",
                                      "--diffusion-quantization-config", '{"vae": true}'))
    typo = parse_quantization("fp8", '{"dit": {"exclude": ["transformer_block.0.*"]}}')
    with pytest.raises(ConfigError, match=r"dit.exclude pattern 'transformer_block.0.\*' matches none of its \d+ "):
        check_engine(check_config(EngineConfig(model=tiny_checkpoint, quantization=typo)))
    # a pattern that matches only a kept layer excludes nothing either
    kept = parse_quantization("fp8", '{"text_encoder": {"exclude": ["visual.*"]}}')
    with pytest.raises(ConfigError, match="text_encoder.exclude pattern 'visual.*' matches none"):
        check_engine(check_config(EngineConfig(model=tiny_checkpoint, quantization=kept)))
    fine = parse_quantization("fp8", '{"dit": {"exclude": ["transformer_blocks.0.*"]}}')
    check_engine(check_config(EngineConfig(model=tiny_checkpoint, quantization=fine)))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU refusal")
def test_fp8_gemm_on_cpu_is_refused_with_the_reason(tiny_checkpoint):
    gemm = parse_quantization("fp8", '{"kernel": "fp8_gemm"}')
    with pytest.raises(ConfigError, match='kernel "fp8_gemm" cannot run here: the cpu device has no FP8 GEMM'):
        check_engine(check_config(EngineConfig(model=tiny_checkpoint, device="cpu", quantization=gemm)))
