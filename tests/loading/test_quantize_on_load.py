"""FP8 at load: the selected linears hold exactly the quantised checkpoint weights, a checkpoint that stores
F8_E4M3 + weight_scale loads as it is (modular DiT and text encoder, native DiT: the stored bytes and scales, the
online-quantised run's outputs), FP8 under offload (rank-local DLO) is byte-identical to resident FP8, and
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
from h3serve.accel.quantize import selected_linears
from h3serve.config.quantization_config import ComponentQuant, parse_quantization
from h3serve.entrypoints.engine_args import add_engine_args, engine_config_from_args
from h3serve.loading.components import load_transformer
from h3serve.offload.inventory import build_inventory
from h3serve.offload.runtime import tensor_bytes
from h3serve.rank.model_runner import ModelRunner
from h3serve.rules.request import GenerationRequest


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


def _engine(checkpoint, flags: str, quantization: bool = True) -> ModelRunner:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    fp8 = "--quantization fp8" if quantization else ""
    args = parser.parse_args(shlex.split(f"--device cpu --threads 1 {fp8} {flags}"))
    return ModelRunner(engine_config_from_args(args, checkpoint))


def test_fp8_under_rank_local_dlo_is_byte_identical_to_resident_fp8(tiny_checkpoint):
    request = GenerationRequest(prompt="a lighthouse at dusk", steps=2, seed=7, duration_s=4)
    resident = _engine(tiny_checkpoint, "--task-type t2va")
    dlo = _engine(
        tiny_checkpoint,
        "--task-type t2va --enable-distributed-layerwise-offload --dlo-no-use-allgather --dlo-resident-layers 1",
    )
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


# ------------------------------------------------------------------------------------------------------------
# Pre-quantised checkpoints: the modular layout (DiT and text encoder) and the native DiT layout
# ------------------------------------------------------------------------------------------------------------


def _quantised(tensors: dict[str, torch.Tensor], selects) -> dict[str, torch.Tensor]:
    """The tensors with every selected 2-D weight stored as F8_E4M3 plus its per-channel `weight_scale`."""
    out = dict(tensors)
    for key, tensor in tensors.items():
        module = key[: -len(".weight")]
        if key.endswith(".weight") and tensor.ndim == 2 and selects(module):
            out[key], out[f"{module}.weight_scale"] = quantize_fp8(tensor, True)
    return out


def _fp8_layers(model: nn.Module) -> dict[str, Fp8Linear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, Fp8Linear)}


def _same_layers(loaded: nn.Module, reference: nn.Module) -> None:
    """Every FP8 layer holds the reference's exact bytes and scales (and the set of FP8 layers is the same)."""
    got, want = _fp8_layers(loaded), _fp8_layers(reference)
    assert sorted(got) == sorted(want) and got
    for name, layer in got.items():
        assert torch.equal(layer.weight.view(torch.uint8), want[name].weight.view(torch.uint8)), name
        assert torch.equal(layer.weight_scale, want[name].weight_scale), name


def _stored_modular_checkpoint(tiny_checkpoint, out):
    """A copy of the tiny checkpoint whose DiT and text encoder store the default FP8 module sets."""
    from h3serve.checkpoint.text_encoder_names import checkpoint_key_to_name

    shutil.copytree(tiny_checkpoint, out)
    quant = ComponentQuant()
    dit = out / "transformer" / "diffusion_pytorch_model.safetensors"
    save_file(_quantised(_checkpoint_tensors(out / "transformer"), lambda m: quant.selects("transformer", m)), dit)
    text = out / "text_encoder" / "model.safetensors"
    with safe_open(str(text), framework="pt") as f:
        tensors, metadata = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()

    def selects(module: str) -> bool:
        name = checkpoint_key_to_name(f"{module}.weight", 10**6)
        return name is not None and quant.selects("text_encoder", name[: -len(".weight")])

    save_file(_quantised(tensors, selects), text, metadata)
    return out


@pytest.mark.slow  # two engines loaded and run (~10 s of CPU)
def test_a_stored_fp8_modular_checkpoint_runs_as_the_online_quantised_one(tiny_checkpoint, tmp_path):
    stored = _stored_modular_checkpoint(tiny_checkpoint, tmp_path / "stored")
    request = GenerationRequest(prompt="a lighthouse at dusk", steps=2, seed=7, duration_s=4)
    online = _engine(tiny_checkpoint, "--task-type t2va")
    loaded = _engine(stored, "--task-type t2va", quantization=False)  # no --quantization: the stored bytes
    for name in ("transformer", "text"):
        ours, theirs = getattr(loaded.pipeline.components, name), getattr(online.pipeline.components, name)
        _same_layers(getattr(ours, "model", ours), getattr(theirs, "model", theirs))
    a, b = online.generate(online.plan(request)), loaded.generate(loaded.plan(request))
    assert np.array_equal(a.video, b.video) and np.array_equal(a.audio, b.audio)


def test_a_stored_fp8_native_dit_loads_its_bytes_and_runs_as_the_online_one(tiny_native_checkpoint, tmp_path):
    from h3serve.loading import dit_keys as keys
    from h3serve.tools.bench.dit_forward import DitBenchSpec, forward_inputs

    source = tiny_native_checkpoint / "FL2VA" / "transformer"
    online = load_transformer(source, quant=ComponentQuant())
    cfg = online.config
    native = keys.diffusers_to_native(online.state_dict(), cfg.attention_head_dim, "interleaved")
    assert native["blocks.0.attn.qkv_proj.weight"].dtype == FP8 and "blocks.0.mlp.fc1.weight_scale" in native
    folder = tmp_path / "transformer"
    folder.mkdir()
    shutil.copy(source / "config.json", folder)
    save_file(native, str(folder / "diffusion_pytorch_model.safetensors"))
    loaded = load_transformer(folder)  # no quantization asked: the stored FP8 layers only
    _same_layers(loaded, online)
    spec = DitBenchSpec(64, 64, 22, 8, torch.device("cpu"), torch.float32, None)
    x = forward_inputs(cfg, spec)
    with torch.no_grad():
        outs = [m(x.video, x.audio, m.embed_text(x.text), x.timestep, x.row_index, x.packed) for m in (loaded, online)]
    assert all(torch.equal(a, b) for a, b in zip(*outs, strict=True))
    _each_shard_reads_its_rows(folder, online)


def _each_shard_reads_its_rows(folder, whole: nn.Module) -> None:
    """Under TP2 a stored native FP8 checkpoint yields each rank exactly its rows (and scales) of the one-rank
    FP8 tensors: q/k/v cut from the fused qkv_proj by heads, the FFN input as its [value; gate] pair split."""
    from h3serve.loading.dit_shards import iter_dit_shards
    from h3serve.model.transformer import H3Transformer
    from h3serve.parallel.tensor_parallel import TensorParallel

    full = whole.state_dict()
    files = sorted(folder.glob("*.safetensors"))
    for rank in range(2):
        tp = TensorParallel(rank, 2, None, H3Transformer.tensor_parallel_plan)
        shard = dict(iter_dit_shards(files, whole.config, True, "interleaved", tp))
        for stem in ("transformer_blocks.0.attn.to_k", "transformer_blocks.1.ff.net.0.proj"):
            for kind in ("weight", "weight_scale"):
                name = f"{stem}.{kind}"
                ranges = tp.ranges(name, tuple(full[name].shape))
                want = torch.cat([full[name][a:b] for a, b in ranges[1]])
                got = shard[name].reshape(want.shape)
                assert got.dtype == want.dtype and torch.equal(got.view(torch.uint8), want.view(torch.uint8)), name


def test_the_planner_counts_a_stored_fp8_checkpoint_without_the_flag(tiny_checkpoint, tmp_path):
    from h3serve.checkpoint.resolver import read_layout
    from h3serve.loading.components import load_components

    stored = _stored_modular_checkpoint(tiny_checkpoint, tmp_path / "stored")
    inv = build_inventory(stored, dits=("transformer",), device_type="cpu")  # no quantization asked
    loaded = load_components(read_layout(stored, ("transformer",)), dits=("transformer",))
    for name, module in (("transformer", loaded.transformer), ("text_encoder", loaded.text.model)):
        assert _fp8_layers(module) and inv.ranks[0][name].total_bytes == tensor_bytes(module), name
