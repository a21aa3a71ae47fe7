"""FlashGen's native 4-step LoRA on the tiny checkpoint: recognised by its metadata, its contract checked from the
header, and the served (unmerged) output against the test's own merge: each native delta B@A converted to the
DiT's names by the checkpoint key map (h3serve.loading.dit_keys: the grouped QKV is the MiniMaxAI per-head "interleaved"
order, fc1 the native [gate; up]) and added to the plain pipeline's weights."""

from __future__ import annotations

import dataclasses
import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from h3serve.adapters.catalog import LoraCatalog, LoraField
from h3serve.adapters.flashgen import FINAL_TARGET, inspect_flashgen, native_shapes
from h3serve.adapters.header import AdapterError, read_header
from h3serve.adapters.peft import target_shapes
from h3serve.checkpoint.native_names import native_to_diffusers_name
from h3serve.config.engine_config import EngineConfig
from h3serve.config.offload_config import OffloadConfig
from h3serve.config_checks import check_config
from h3serve.errors import ConfigError
from h3serve.loading.dit_keys import split_native_tensor
from h3serve.model.transformer_config import H3TransformerConfig
from h3serve.rank.model_runner import ModelRunner
from h3serve.rules.request import GenerationRequest, MediaRef
from h3serve.rules.validate import RequestError, validate
from h3serve.tools.tiny.make_adapter import save_file, write_flashgen_adapter

PROMPT = "a red ball moving left"


def _config(checkpoint) -> dict:
    return json.loads((checkpoint / "transformer" / "config.json").read_text())


@pytest.fixture(scope="module")
def flash_file(tiny_checkpoint, tmp_path_factory):
    return write_flashgen_adapter(tmp_path_factory.mktemp("flashgen"), _config(tiny_checkpoint), rank=4, seed=5,
                                  std=0.15)


@pytest.fixture(scope="module")
def engine(tiny_checkpoint, flash_file):
    return ModelRunner(EngineConfig(model=tiny_checkpoint, threads=1, task_type="fl2va",
                                    lora_paths=(("flash", str(flash_file)),)))


def _choice(checkpoint, path, **field):
    cfg = _config(checkpoint)
    catalog = LoraCatalog(target_shapes(cfg), {"flash": str(path)}, log=lambda s: None, dit_config=cfg)
    return catalog.choose(LoraField(name="flash", **field))


def _merged_reference(plain, plan, path, scale: float, cfg: dict):
    tensors = load_file(str(path))
    dit = plain.components.transformer
    original = {k: v.clone() for k, v in dit.state_dict().items()}
    try:
        with torch.no_grad():
            for native in native_shapes(cfg):
                a = tensors[f"transformer.{native}.lora_A.default.weight"]
                b = tensors[f"transformer.{native}.lora_B.default.weight"]
                name = native_to_diffusers_name(f"{native}.weight")
                for target, delta in split_native_tensor(name, scale * (b @ a), cfg["num_attention_heads"],
                                                              cfg["attention_head_dim"], "interleaved"):
                    dit.get_parameter(target).add_(delta)
        return plain.generate(plan)
    finally:
        dit.load_state_dict(original)


def test_the_served_output_equals_the_tests_own_merge(tiny_pipeline, tiny_checkpoint, flash_file, engine):
    plain, _ = tiny_pipeline
    choice = _choice(tiny_checkpoint, flash_file, scale=0.7)
    fg = choice.flashgen
    assert fg is not None and fg.forwards == 4 and fg.tasks == ("t2va",) and (choice.rank, choice.alpha) == (4, 4.0)
    plan = engine.plan(GenerationRequest(prompt=PROMPT, duration_s=4, seed=2, lora=choice))
    assert plan.steps == 4 and plan.pinned_positions == (1.0, 0.7, 0.4, 0.15, 0.0)
    engine.lora.activate_for(plan)  # what LocalEngine.generate does first
    served = engine.pipeline.generate(plan)
    assert engine.pipeline.components.transformer.adaln_adapter.startswith(str(flash_file))  # the memo's key
    reference = _merged_reference(plain, plan, flash_file, 0.7, _config(tiny_checkpoint))
    assert (served.video_latents - reference.video_latents).abs().max() <= 1e-4
    assert (served.audio_latents - reference.audio_latents).abs().max() <= 1e-4
    # The next request without it is the base model again, AdaLN memo included.
    base_plan = engine.plan(GenerationRequest(prompt=PROMPT, duration_s=4, seed=2, steps=4))
    engine.lora.activate_for(base_plan)
    assert engine.pipeline.components.transformer.adaln_adapter == ""
    base = engine.pipeline.generate(base_plan)
    assert (served.video_latents - base.video_latents).abs().max() > 0.05  # the adapter shows


def test_requests_outside_its_contract_are_refused_by_name(tiny_checkpoint, flash_file, engine):
    base = GenerationRequest(prompt=PROMPT, duration_s=4, lora=_choice(tiny_checkpoint, flash_file))
    with pytest.raises(RequestError, match="4-step FlashGen LoRA flash .* runs exactly 4 steps") as e:
        engine.plan(dataclasses.replace(base, steps=8))
    assert e.value.field == "steps"
    keyframe = MediaRef(Path("first.png"), "first.png", "image")
    with pytest.raises(RequestError, match="serves t2va, not fl2va") as e:
        validate(dataclasses.replace(base, image=keyframe), engine.defaults)
    assert e.value.field == "lora"
    assert engine.plan(dataclasses.replace(base, steps=4)).steps == 4  # restating it is fine


@pytest.mark.parametrize(
    "change, says",
    [
        ({"metadata": {"qkv_layout": "stacked"}}, "qkv_layout 'stacked'; FlashGen's fused QKV is grouped"),
        ({"metadata": {"base_schedule": "1.0,0.5,0.25,0.0"}}, "holds 3 intervals; .* exactly 4"),
        ({"metadata": {"base_schedule": "1.0,0.7,0.8,0.15,0.0"}}, "strictly decreasing"),
        ({"metadata": {"tasks": "ref2va"}}, "never Ref2VA"),
        ({"metadata": {"lora_rank": "x"}}, "lora_rank must be a number"),
        ({"drop": f"transformer.{FINAL_TARGET}.lora_B.default.weight"}, "lacks transformer.final_layer"),
        ({"reshape": "transformer.blocks.0.attn.qkv_proj.lora_B.default.weight"}, r"expected \[384, 4\]"),
    ],
)
def test_the_files_contract_is_checked_from_its_header(tiny_checkpoint, flash_file, tmp_path, change, says):
    cfg = _config(tiny_checkpoint)
    header = read_header(flash_file)
    tensors = load_file(str(flash_file))
    if "drop" in change:
        del tensors[change["drop"]]
    if "reshape" in change:
        tensors[change["reshape"]] = torch.zeros(383, 4)
    path = tmp_path / flash_file.name
    save_file(tensors, str(path), metadata={**header.metadata, **change.get("metadata", {})})
    with pytest.raises(AdapterError, match=says):
        inspect_flashgen(read_header(path), cfg)


def test_start_up_refuses_what_the_contract_refuses(tiny_checkpoint, flash_file):
    lora = (("flash", str(flash_file)),)
    for overrides, says in (
        ({"task_type": "ref2va"}, "Ref2VA is refused"),
        ({"offload": OffloadConfig(staged=frozenset({"dit"}))}, "model-level and layerwise DiT offload are refused"),
        ({"offload": OffloadConfig(streamed=frozenset({"dit"}))}, "model-level and layerwise DiT offload are refused"),
    ):
        with pytest.raises(ConfigError, match=says):
            check_config(EngineConfig(model=tiny_checkpoint, lora_paths=lora, **overrides))


def test_the_released_size_is_259_targets_of_the_documented_shapes(tmp_path):
    """The full-size DiT: a header-only file of 259 targets at rank 64 passes the check, with the documented
    in -> out widths (qkv 5376 -> 21504, fc1 5376 -> 28672, block AdaLN 2688 -> 96768, final AdaLN 2688 -> 10752)."""
    cfg = dataclasses.asdict(H3TransformerConfig())
    shapes = native_shapes(cfg)
    assert len(shapes) == 259
    widths = {t.split(".", 2)[-1] if t.startswith("blocks.") else t: (i, o) for t, (o, i) in shapes.items()}
    assert widths["attn.qkv_proj"] == (5376, 21504) and widths["attn.out_proj"] == (7168, 5376)
    assert widths["mlp.fc1"] == (5376, 28672) and widths["mlp.fc2"] == (14336, 5376)
    assert widths["adaln_proj.linear"] == (2688, 96768) and widths[FINAL_TARGET] == (2688, 10752)
    header = {}
    for t, (o, i) in shapes.items():
        header[f"transformer.{t}.lora_A.default.weight"] = {"dtype": "BF16", "shape": [64, i], "data_offsets": [0, 0]}
        header[f"transformer.{t}.lora_B.default.weight"] = {"dtype": "BF16", "shape": [o, 64], "data_offsets": [0, 0]}
    header["__metadata__"] = {"key_format": "minimax-h3-native", "qkv_layout": "grouped", "lora_rank": "64",
                              "lora_alpha": "64", "tasks": "t2va", "base_schedule": "1.0,0.7,0.4,0.15,0.0"}
    path = tmp_path / "minimax_h3_t2va_flashgen_4step_v1.0_768p_bf16.safetensors"
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text)  # the header alone: nothing is read past it
    found = inspect_flashgen(read_header(path), cfg)
    assert (found.lora.rank, found.lora.unit_scale, found.contract.forwards) == (64, 1.0, 4)
