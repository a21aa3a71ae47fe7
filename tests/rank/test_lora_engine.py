"""LoRA in the engine: requests with two adapters and none, interleaved on one loaded engine, each equal their own
reference (the DiT's weights merged by the test in plain torch; the unadapted engine bit for bit)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from h3serve.adapters.catalog import LoraCatalog, LoraField
from h3serve.adapters.peft import target_shapes
from h3serve.config import EngineConfig
from h3serve.rank.local import LocalEngine
from h3serve.request import GenerationRequest
from h3serve.tools.tiny_adapter import write_peft_adapter


def _merge_into(dit, adapter, scale: float, alpha: float, rank: int) -> None:
    """The test's own merge in plain torch: W += s·alpha/r·B@A (q/k/v into their rows of the fused projection)."""
    factors = load_file(str(adapter))
    with torch.no_grad():
        for key, a in factors.items():
            if ".lora_A." not in key:
                continue
            module = key.split(".lora_A.")[0]
            delta = scale * alpha / rank * (factors[key.replace(".lora_A.", ".lora_B.")] @ a)
            block, _, part = module.rpartition(".")
            if part in ("to_q", "to_k", "to_v") and getattr(dit.get_submodule(block), "to_qkv", None) is not None:
                weight = dit.get_submodule(f"{block}.to_qkv").weight
                rows = delta.shape[0]
                weight[rows * "qkv".index(part[-1]) : rows * ("qkv".index(part[-1]) + 1)] += delta
            else:
                dit.get_submodule(module).weight += delta


def _request(lora=None) -> GenerationRequest:
    return GenerationRequest(prompt="a fox", steps=1, duration_s=4, seed=5, lora=lora)


@pytest.fixture(scope="module")
def adapters(tiny_checkpoint, tmp_path_factory):
    root = tmp_path_factory.mktemp("engine-loras")
    cfg = json.loads((tiny_checkpoint / "transformer" / "config.json").read_text())
    return root, {
        "a": write_peft_adapter(root / "a", cfg, rank=4, alpha=4.0, seed=1, std=0.3),
        "b": write_peft_adapter(root / "b", cfg, rank=2, alpha=4.0, seed=2, std=0.3),
    }


def test_two_adapters_and_none_interleaved_each_equal_their_reference(tiny_checkpoint, tiny_pipeline, adapters):
    root, files = adapters
    paths = (("a", str(files["a"].parent)), ("b", str(files["b"].parent)))
    config = EngineConfig(model=tiny_checkpoint, threads=1, task_type="fl2va", lora_paths=paths, max_loras=1)
    engine = LocalEngine(config)
    catalog = LoraCatalog(target_shapes(json.loads((tiny_checkpoint / "transformer" / "config.json").read_text())),
                          dict(paths), log=lambda s: None)
    plain, _ = tiny_pipeline  # the session's unadapted pipeline (Q/K/V unfused: bit-identical to fused)
    plan = engine.plan(_request())
    references = {None: plain.generate(plan).video.numpy()}
    dit = plain.components.transformer
    original = {k: v.clone() for k, v in dit.state_dict().items()}
    try:
        for name, (rank, scale) in {"a": (4, 1.0), "b": (2, 0.5)}.items():
            _merge_into(dit, files[name], scale, 4.0, rank)
            references[name] = plain.generate(plan).video.numpy()
            dit.load_state_dict(original)
    finally:
        dit.load_state_dict(original)
    scales = {"a": 1.0, "b": 0.5}
    for name in ("a", None, "b", "a"):
        lora = None if name is None else catalog.choose(LoraField(name=name, scale=scales[name]))
        video = engine.generate(engine.plan(_request(lora))).video
        if name is None:
            assert np.array_equal(video, references[None])
        else:
            assert np.abs(video - references[name]).max() <= 1e-4, name
            assert np.abs(video - references[None]).max() > 1e-2  # the adapter shows
    assert engine.lora.active == {"transformer": "a"} and len(engine.lora.device.items) == 1
    assert isinstance(engine.pipeline.components.transformer.transformer_blocks[0].ff.net[2].lora_scale, torch.Tensor)


def test_lora_with_dit_offload_is_refused_with_the_reason(tiny_checkpoint, adapters):
    from h3serve.config import ConfigError
    from h3serve.offload.config import OffloadConfig

    _, files = adapters
    with pytest.raises(ConfigError, match="LoRA is not available with DiT offload .* adapter factors would have"):
        EngineConfig(model=tiny_checkpoint, lora_paths=(("a", str(files["a"])),),
                     offload=OffloadConfig(streamed=frozenset({"dit"}))).validate()
