"""FastH3, fused at load: the loaded weights equal the fp32 arithmetic done here; every identity, count and
layout rule refuses with its reason."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from small_dit import SMALL_DIT

from h3serve.adapters.fasth3 import adapter_path, is_fasth3_path, read_fasth3
from h3serve.adapters.header import AdapterError
from h3serve.loading.components import load_transformer
from h3serve.model.transformer import H3Transformer, H3TransformerConfig
from h3serve.tools.tiny.make_adapter import fasth3_metadata, fasth3_tensors, write_fasth3_adapter

CFG = {**SMALL_DIT, "in_channels": 24}


@pytest.fixture(scope="module")
def dit_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fasth3") / "transformer"
    folder.mkdir()
    torch.manual_seed(0)
    model = H3Transformer(H3TransformerConfig(**SMALL_DIT))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(SMALL_DIT))
    return folder


def test_fused_weights_equal_the_fp32_arithmetic(dit_folder, tmp_path):
    path = write_fasth3_adapter(tmp_path / "fasth3", CFG, rank=3, seed=7)
    base = load_file(str(dit_folder / "model.safetensors"))
    edits = load_file(str(path))
    expected = {k: v.clone() for k, v in base.items()}
    for key, a in edits.items():
        if key.endswith(".lora_A.weight"):
            module = key.removesuffix(".lora_A.weight")
            expected[f"{module}.weight"] += edits[f"{module}.lora_B.weight"].double().matmul(a.double()).float()
        elif key.endswith(".diff"):
            expected[key.removesuffix(".diff") + ".weight"] += edits[key]
        elif key.endswith(".diff_b"):
            expected[key.removesuffix(".diff_b") + ".bias"] += edits[key]
    for dtype in (torch.float32, torch.bfloat16):
        fused = load_transformer(dit_folder, dtype=dtype, adapter=str(path.parent)).state_dict()
        changed = 0
        for name, want in expected.items():
            fp32 = name.split(".")[0] in H3Transformer.keep_in_fp32_modules
            target = want if dtype == torch.float32 or fp32 else want.to(dtype)
            assert torch.allclose(fused[name].float(), target.float(), atol=1e-6, rtol=0), name
            changed += not torch.equal(want, base[name])
        assert changed == 6 * 3 + 2 * 3 + 3  # 6 LoRA targets, 2 norms per block (3 blocks), the head and bias, t-emb
    assert is_fasth3_path(path) and not is_fasth3_path(dit_folder / "model.safetensors")


def _save(folder, tensors, metadata):
    folder.mkdir(exist_ok=True)
    path = folder / "a.safetensors"
    save_file(tensors, str(path), metadata=metadata)
    return path


def test_every_rule_refuses_with_its_reason(dit_folder, tmp_path):
    tensors = fasth3_tensors(CFG, rank=2, seed=1)
    meta = fasth3_metadata(tensors)
    cases = [
        ({}, {"format": "peft"}, "metadata format 'peft'; a FastH3 adapter is fastvideo-lora-v2"),
        ({}, {"finetuned_model": "someone/fasth3"}, "is not a fastvideo/ FastH3 model"),
        ({}, {"finetuned_model": "fastvideo/other"}, "is not a fastvideo/ FastH3 model"),
        ({}, {"base_model": "Wan-AI/Wan2.2"}, "FastH3 adapts MiniMaxAI/MiniMax-H3"),
        ({}, {"low_rank_tensors": "3"}, r"low_rank_tensors = 3, the file holds \d+"),
        ({}, {"diff_tensors": "0"}, r"diff_tensors = 0, the file holds \d+"),
        ({"transformer_blocks.0.attn.gate.set_weight": torch.zeros(2)}, {"set_weight_tensors": "1"},
         r"1 \.set_weight tensors \(a sparse-attention variant"),
    ]
    for i, (extra, meta_change, message) in enumerate(cases):
        path = _save(tmp_path / f"c{i}", {**tensors, **extra}, {**meta, **meta_change})
        with pytest.raises(AdapterError, match=message):
            load_transformer(dit_folder, adapter=str(path))
    no_block = {k: v for k, v in tensors.items() if not k.startswith("token_refiner.refiner_blocks.0.")}
    path = _save(tmp_path / "noblock", no_block, fasth3_metadata(no_block))
    with pytest.raises(AdapterError, match=r"edits no tensor of token_refiner.refiner_blocks.0 \(1 blocks unedited"):
        load_transformer(dit_folder, adapter=str(path))
    stray = {**tensors, "transformer_blocks.0.nonexistent.diff": torch.zeros(3)}
    path = _save(tmp_path / "stray", stray, fasth3_metadata(stray))
    with pytest.raises(AdapterError, match="maps to 'transformer_blocks.0.nonexistent.weight', which is not a param"):
        load_transformer(dit_folder, adapter=str(path))
    bundle = tmp_path / "bundle"
    _save(bundle, tensors, meta)
    (bundle / "adapter_manifest.json").write_text("{}")
    with pytest.raises(AdapterError, match="a bundle with adapter_manifest.json"):
        adapter_path(bundle)
    assert read_fasth3(_save(tmp_path / "ok", tensors, meta)).model == "fastvideo/FastH3-tiny-synthetic"


def test_a_fasth3_file_given_to_lora_path_is_fused_and_a_bad_one_is_refused(tiny_checkpoint, tmp_path):
    import argparse

    from h3serve.entrypoints.engine_args import add_engine_args, engine_config_from_args
    from h3serve.errors import ConfigError

    cfg = json.loads((tiny_checkpoint / "transformer" / "config.json").read_text())
    good = write_fasth3_adapter(tmp_path / "good", cfg, rank=2)
    parser = argparse.ArgumentParser()
    add_engine_args(parser)

    def config(*flags: str):
        return engine_config_from_args(parser.parse_args(["--device", "cpu", *flags]), tiny_checkpoint)

    loaded = config("--lora-path", f"fast={good.parent}")
    assert loaded.dit_adapter == str(good.parent) and loaded.lora_paths == ()
    bad = _save(tmp_path / "bad", load_file(str(good)), {**fasth3_metadata(load_file(str(good))), "diff_tensors": "1"})
    with pytest.raises(ConfigError, match=r"--dit-adapter .*a.safetensors: metadata diff_tensors = 1, the file holds"):
        config("--dit-adapter", str(bad))
    with pytest.raises(ConfigError, match="one FastH3 adapter at most"):
        config("--dit-adapter", str(bad), "--lora-path", str(good))
