"""FP8 at load: the selected linears hold exactly the quantised checkpoint weights, a checkpoint that stores
F8_E4M3 + weight_scale loads as it is, FP8 under offload (rank-local DLO) is byte-identical to resident FP8, and
the planner's FP8 bytes are the loaded model's."""

from __future__ import annotations

import argparse
import shlex
import shutil

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from h3serve.accel.fp8 import FP8, Fp8Linear, quantize_fp8
from h3serve.accel.quant_config import ComponentQuant, parse_quantization
from h3serve.accel.quantize import selected_linears
from h3serve.engine.args import add_engine_args, engine_config_from_args
from h3serve.offload.inventory import build_inventory
from h3serve.offload.runtime import tensor_bytes
from h3serve.rank.checkpoint import load_transformer
from h3serve.rank.local import LocalEngine
from h3serve.request import GenerationRequest


def _checkpoint_tensors(folder) -> dict[str, torch.Tensor]:
    with safe_open(str(folder / "diffusion_pytorch_model.safetensors"), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


@pytest.mark.parametrize("per_channel", [True, False])
def test_quantised_layers_hold_the_quantised_checkpoint_weights(tiny_checkpoint, per_channel):
    quant = ComponentQuant("per_channel" if per_channel else "per_tensor")
    model = load_transformer(tiny_checkpoint / "transformer", quant=quant)
    stored = _checkpoint_tensors(tiny_checkpoint / "transformer")
    layers = {n: m for n, m in model.named_modules() if isinstance(m, Fp8Linear)}
    assert sorted(layers) == sorted(n for n in stored_names(stored) if quant.selects("transformer", n))
    for name, layer in layers.items():
        q, scale = quantize_fp8(stored[f"{name}.weight"], per_channel)
        assert layer.weight.dtype == FP8 and torch.equal(layer.weight.view(torch.uint8), q.view(torch.uint8))
        assert torch.equal(layer.weight_scale, scale)
    assert type(model.proj_in) is nn.Linear and model.proj_in.weight.dtype == torch.float32


def stored_names(tensors: dict[str, torch.Tensor]) -> list[str]:
    return [k[: -len(".weight")] for k, t in tensors.items() if k.endswith(".weight") and t.ndim == 2]


def test_a_stored_fp8_checkpoint_loads_without_requantising(tiny_checkpoint, tmp_path):
    folder = tmp_path / "transformer"
    folder.mkdir()
    shutil.copy(tiny_checkpoint / "transformer" / "config.json", folder)
    tensors = _checkpoint_tensors(tiny_checkpoint / "transformer")
    chosen = [n for n in stored_names(tensors) if ComponentQuant().selects("transformer", n)]
    expected = {}
    for name in chosen:  # stored per channel as a flat [out] vector (the compressed-tensors layout)
        q, scale = quantize_fp8(tensors[f"{name}.weight"] * 3.0, True)
        tensors[f"{name}.weight"], tensors[f"{name}.weight_scale"] = q, scale.reshape(-1)
        expected[name] = (q, scale)
    save_file(tensors, str(folder / "diffusion_pytorch_model.safetensors"))
    # Without --quantization, and with a per-tensor config: the stored weights and scales, untouched.
    for quant in (None, ComponentQuant("per_tensor")):
        model = load_transformer(folder, quant=quant)
        for name, (q, scale) in expected.items():
            layer = model.get_submodule(name)
            assert torch.equal(layer.weight.view(torch.uint8), q.view(torch.uint8))
            assert torch.equal(layer.weight_scale, scale)


def test_planner_counts_the_loaded_fp8_bytes(tiny_checkpoint):
    config = parse_quantization("fp8", '{"granularity": "per_tensor", "text_encoder": false}')
    inv = build_inventory(tiny_checkpoint, dits=("transformer",), device_type="cpu", quantization=config)
    model = load_transformer(tiny_checkpoint / "transformer", quant=config.component("transformer"))
    assert inv.ranks[0]["transformer"].total_bytes == tensor_bytes(model)
    full = build_inventory(tiny_checkpoint, dits=("transformer",), device_type="cpu")
    names = selected_linears(load_transformer(tiny_checkpoint / "transformer"), "transformer", ComponentQuant())
    weights = sum(model.get_submodule(n).weight.numel() for n in names)
    saved = full.ranks[0]["transformer"].total_bytes - inv.ranks[0]["transformer"].total_bytes
    assert saved == weights * 3 - 4 * len(names)  # fp32 -> 1 byte a weight, plus one float32 scale a layer


def _engine(checkpoint, flags: str) -> LocalEngine:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(shlex.split(f"--device cpu --threads 1 --quantization fp8 {flags}"))
    return LocalEngine(engine_config_from_args(args, checkpoint))


def test_fp8_under_rank_local_dlo_is_byte_identical_to_resident_fp8(tiny_checkpoint):
    request = GenerationRequest(prompt="a lighthouse at dusk", steps=2, seed=7, duration_s=4)
    resident = _engine(tiny_checkpoint, "--task-type t2va")
    dlo = _engine(tiny_checkpoint, "--task-type t2va --enable-distributed-layerwise-offload --dlo-no-use-allgather "
                                   "--dlo-resident-layers 1")
    a = resident.generate(resident.plan(request))
    b = dlo.generate(dlo.plan(request))
    assert np.array_equal(a.video, b.video) and np.array_equal(a.audio, b.audio)
    blocks = dlo.pipeline.components.transformer.transformer_blocks
    assert isinstance(blocks[1].attn.to_qkv, Fp8Linear)  # streamed block: FP8 bytes and scales travel
    assert dlo.offload.log.peak("denoise", "transformer", "stream") > 0


def test_a_shard_reads_the_scales_of_its_rows():
    """Stored FP8 under TP: a column split reads its rows' scales, a row split (input features) and a per-tensor
    scale read the whole scale."""
    from h3serve.model.transformer import H3Transformer
    from h3serve.parallel.tensor_parallel import TensorParallel

    tp = TensorParallel(1, 2, None, H3Transformer.tensor_parallel_plan)
    assert tp.ranges("transformer_blocks.0.attn.to_q.weight_scale", (64, 1)) == (0, [(32, 64)])
    assert tp.ranges("transformer_blocks.0.attn.to_q.weight_scale", (64,)) == (0, [(32, 64)])
    assert tp.ranges("transformer_blocks.0.ff.net.0.proj.weight_scale", (128, 1)) == (0, [(32, 64), (96, 128)])
    assert tp.ranges("transformer_blocks.0.attn.to_out.0.weight_scale", (48, 1)) is None
    assert tp.ranges("transformer_blocks.0.attn.to_q.weight_scale", ()) is None
    assert tp.ranges("transformer_blocks.0.attn.to_out.0.weight", (48, 64)) == (1, [(32, 64)])
