"""FastVideo's FastH3 8-step V2 tree: `fastvideo_inference.json` checked key by key, the base checkpoint's VAEs, the
start-up and request refusals, and a tiny V2 tree served end to end on video sparse attention."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from h3serve.checkpoint.fasth3_v2 import CONTRACT, INFERENCE_FILE, PROVENANCE_FILE, read_contract
from h3serve.checkpoint.resolver import CheckpointError, read_layout
from h3serve.config.engine_config import EngineConfig
from h3serve.config_checks import check_config
from h3serve.errors import ConfigError
from h3serve.rules.request import GenerationRequest, MediaRef
from h3serve.rules.validate import RequestError, validate
from h3serve.tools.tiny.make_fasth3_v2 import TINY_BASE_REVISION, v2_from_modular

VSA = {"attention_backend": "FASTVIDEO_VSA"}


@pytest.fixture(scope="module")
def v2(tiny_checkpoint, tmp_path_factory):
    return v2_from_modular(tiny_checkpoint, tmp_path_factory.mktemp("v2") / "FastH3-8-Step-V2", seed=4)


def _copy_with(v2, tmp_path, contract=None, provenance=None):
    root = tmp_path / "v2"
    shutil.copytree(v2, root, symlinks=True)
    if contract is not None:
        (root / INFERENCE_FILE).write_text(json.dumps(contract))
    if provenance is not None:
        (root / PROVENANCE_FILE).write_text(json.dumps(provenance))
    return root


def test_the_contract_pins_8_forwards_at_shifts_10_3_and_vsa(v2, tiny_checkpoint):
    contract = read_contract(v2)
    assert contract.positions == (0.999, 0.874, 0.749, 0.624, 0.5, 0.375, 0.25, 0.125, 0.0)
    assert (contract.video_shift, contract.audio_shift, contract.sparsity, contract.tile_size) == (10.0, 3.0, 0.8, 64)
    assert contract.base_revision == TINY_BASE_REVISION
    layout = read_layout(v2, base=tiny_checkpoint)
    assert layout.kind == "fasth3-v2" and not layout.has("transformer_ref")
    assert layout.component("vae") == tiny_checkpoint / "vae"  # from the base, not the Hub id in the index
    defaults = layout.defaults()
    assert (defaults.flow_shift, defaults.audio_flow_shift, defaults.pinned_schedule.forwards) == (10.0, 3.0, 8)
    with pytest.raises(CheckpointError, match="name a local copy with --base-checkpoint"):
        read_layout(v2).component("vae")


def test_the_planner_counts_the_gate_projections(v2, tiny_checkpoint):
    from h3serve.offload.inventory import build_inventory

    def dit_bytes(inv) -> int:
        return inv.ranks[0]["transformer"].total_bytes

    gated = build_inventory(v2, dits=("transformer",), device_type="cpu", base=tiny_checkpoint)
    plain = build_inventory(tiny_checkpoint, dits=("transformer",), device_type="cpu")
    cfg = gated.dits["transformer"]
    gate = cfg.num_layers * (cfg.hidden_size + 1) * cfg.num_attention_heads * cfg.attention_head_dim * 4  # fp32
    assert dit_bytes(gated) - dit_bytes(plain) == gate


@pytest.mark.parametrize(
    "change, says",
    [
        ({"dmd_denoising_steps": [999, 749, 500, 250]}, "dmd_denoising_steps is .* requires"),
        ({"transformer_forwards": 4}, "transformer_forwards is 4"),
        ({"video_scheduler_shift": 12.0}, "video_scheduler_shift is 12.0"),
        ({"guidance_scale": True}, "guidance_scale is True"),
        ({"attention_backend": "FLASH_ATTN"}, "attention_backend is 'FLASH_ATTN'"),
        ({"vsa_sparsity": 0.9}, "vsa_sparsity is 0.9"),
        ({"vsa_tile_size": 128}, "vsa_tile_size is 128"),
        ({"task": "ref2va"}, "task is 'ref2va'"),
        ({"negative_prompt": ""}, r"unknown \['negative_prompt'\]"),
        ({"schema_version": None}, "schema_version is None"),
    ],
)
def test_every_contract_key_is_checked(v2, tmp_path, change, says):
    contract = {**CONTRACT, **change}
    root = _copy_with(v2, tmp_path, contract=contract)
    with pytest.raises(CheckpointError, match=says):
        read_contract(root)


def test_a_missing_key_a_disagreeing_scheduler_and_the_base_revision_are_refused(v2, tmp_path, tiny_checkpoint):
    missing = {k: v for k, v in CONTRACT.items() if k != "vsa_tile_size"}
    with pytest.raises(CheckpointError, match=r"missing \['vsa_tile_size'\]"):
        read_contract(_copy_with(v2, tmp_path / "a", contract=missing))
    root = _copy_with(v2, tmp_path / "b")
    (root / "scheduler" / "scheduler_config.json").write_text(json.dumps({"shift": 12.0}))
    with pytest.raises(CheckpointError, match="shift 12.0 disagrees with fastvideo_inference.json"):
        read_contract(root)
    with pytest.raises(CheckpointError, match="expected hf://MiniMaxAI/MiniMax-H3@<revision>"):
        read_contract(_copy_with(v2, tmp_path / "c", provenance={"base_model_revision": "hf://Other/Model@abc"}))
    snapshot = tmp_path / "hub" / "models--MiniMaxAI--MiniMax-H3" / "snapshots" / ("f" * 40)
    shutil.copytree(tiny_checkpoint, snapshot)
    with pytest.raises(CheckpointError, match=f"pins MiniMaxAI/MiniMax-H3@{TINY_BASE_REVISION}"):
        read_layout(v2, base=snapshot)
    with pytest.raises(CheckpointError, match="vae: none of FL2VA/video_vae"):
        read_layout(v2, base=tmp_path / "b" / "v2" / "scheduler")


def test_start_up_refuses_what_the_contract_refuses(v2, tiny_checkpoint, tmp_path):
    from h3serve.tools.tiny.make_adapter import write_peft_adapter

    adapter = write_peft_adapter(tmp_path / "lora", json.loads((v2 / "transformer" / "config.json").read_text()))
    base = {"model": v2, "base_checkpoint": tiny_checkpoint}
    for overrides, says in (
        ({**VSA, "base_checkpoint": None}, "name a local copy with --base-checkpoint"),
        ({}, "start with --diffusion-attention-backend FASTVIDEO_VSA"),
        ({**VSA, "vsa_topk": 3}, "pins VSA sparsity 0.8; drop --fastvideo-vsa-topk"),
        ({**VSA, "lora_paths": (("x", str(adapter)),)}, "runs no LoRA"),
        ({**VSA, "task_type": "ref2va"}, "not ref2va"),
        ({**VSA, "ulysses_degree": 2, "num_ranks": 2}, "not with --usp/--ring"),
    ):
        with pytest.raises(ConfigError, match=says):
            check_config(EngineConfig(**{**base, **overrides}))
    with pytest.raises(ConfigError, match="only a FastH3 V2 checkpoint takes its VAEs from a base"):
        check_config(EngineConfig(model=tiny_checkpoint, base_checkpoint=tiny_checkpoint))


def test_a_tiny_v2_tree_is_served_on_video_sparse_attention(v2, tiny_checkpoint):
    from h3serve.rank.model_runner import ModelRunner

    engine = ModelRunner(EngineConfig(model=v2, base_checkpoint=tiny_checkpoint, threads=1, **VSA))
    dit = engine.pipeline.components.transformer
    stored = load_file(str(v2 / "transformer" / "diffusion_pytorch_model.safetensors"))
    assert torch.equal(dit.transformer_blocks[1].attn.to_gate_compress.weight,
                       stored["transformer_blocks.1.attn.to_gate_compress.weight"])  # the learned gates loaded
    plan = engine.plan(GenerationRequest(prompt="a red ball", duration_s=4, seed=1))
    assert (plan.steps, plan.flow_shift, plan.audio_flow_shift) == (8, 10.0, 3.0)
    assert plan.pinned_positions[:2] == (0.999, 0.874)
    calls = []
    handle = dit.audio_proj_out.register_forward_hook(lambda *_: calls.append(1))
    try:
        output = engine.generate(plan)
    finally:
        handle.remove()
    assert len(calls) == 8 and output.video.shape[0] == plan.num_frames and output.audio.shape[0] == 2
    vsa = dit.sparse_attention
    assert vsa is not None and 1 <= vsa.topk < vsa.plan.num_tiles  # sparse: 20% of the tiles per query tile
    base = GenerationRequest(prompt="a red ball", duration_s=4)
    keyframe = MediaRef(Path("first.png"), "first.png", "image")
    for change, field in (({"steps": 4}, "steps"), ({"flow_shift": 12.0}, "flow_shift"),
                          ({"audio_flow_shift": 5.0}, "audio_flow_shift"), ({"image": keyframe}, "task")):
        with pytest.raises(RequestError) as e:
            validate(dataclasses.replace(base, **change), engine.defaults)
        assert e.value.field == field and "FastH3 8-step V2" in str(e.value)
    assert engine.plan(dataclasses.replace(base, steps=8, flow_shift=10.0)).steps == 8  # restating it is fine
