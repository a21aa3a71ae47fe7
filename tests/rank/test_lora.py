"""Per-request LoRA, unmerged: equal to a model the test merges with plain torch (on FP8 base weights too), exact
at scale 0, switchable without recompiling."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from safetensors.torch import load_file
from small_dit import SMALL_DIT, random_small_dit
from small_dit import small_dit_inputs as _inputs
from small_dit import small_dit_outputs as _run

from h3serve.accel.compile import CompileState, compile_transformer
from h3serve.accel.fp8 import Fp8Linear
from h3serve.accel.quantize import quantize_in_place
from h3serve.config.quantization_config import ComponentQuant
from h3serve.model.transformer import H3Transformer, H3TransformerConfig
from h3serve.rank.lora import LoraLinear, LoraRuntime, wrapped_targets
from h3serve.rules.adapter_choice import AdapterChoice
from h3serve.tools.tiny.make_adapter import write_peft_adapter

_model = random_small_dit


def _choice(path, name: str, scale: float, rank: int, alpha: float) -> AdapterChoice:
    return AdapterChoice(name, str(path), scale, 1, rank, alpha)


def _merged(model: H3Transformer, path, scale: float, alpha: float, rank: int) -> H3Transformer:
    """The test's own merge, in plain torch: W + s·alpha/r·B@A on diffusers-named weights."""
    merged = copy.deepcopy(model)
    tensors = load_file(str(path))
    with torch.no_grad():
        for key, a in tensors.items():
            if ".lora_A." not in key:
                continue
            module = key.split(".lora_A.")[0]
            b = tensors[key.replace(".lora_A.", ".lora_B.")]
            merged.get_submodule(module).weight += scale * alpha / rank * (b @ a)
    merged.fuse_projections()
    return merged


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("loras")
    cfg = dataclasses.asdict(H3TransformerConfig(**SMALL_DIT))
    return {
        "a": write_peft_adapter(root / "a", cfg, rank=4, alpha=8.0, seed=1),
        "b": write_peft_adapter(root / "b", cfg, rank=4, alpha=2.0, seed=2, std=0.1),
    }


def test_unmerged_equals_the_test_merged_model_and_scale_zero_is_exact(adapters):
    base = _model()
    served = copy.deepcopy(base)
    served.fuse_projections()
    plain = copy.deepcopy(served)
    runtime = LoraRuntime({"transformer": served}, slot_rank=8)
    wrappers = [m for m in served.modules() if isinstance(m, LoraLinear)]
    # every block's q/k/v (fused), out, ff in and ff out: 4 layers x (2 blocks + 1 refiner block)
    assert len(wrappers) == 4 * 3 and served.get_submodule("token_refiner.refiner_blocks.0.attn.to_qkv").groups == 3
    inputs = _inputs()
    reference = _run(plain, inputs)
    for name, alpha, scale in (("a", 8.0, 1.0), ("b", 2.0, 0.7), ("a", 8.0, -0.5)):
        runtime.activate("transformer", _choice(adapters[name], name, scale, 4, alpha))
        ours = _run(served, inputs)
        theirs = _run(_merged(base, adapters[name], scale, alpha, 4), inputs)
        for x, y, r in zip(ours, theirs, reference, strict=True):
            assert (x - y).abs().max() <= 1e-4
            assert (x - r).abs().max() > 1e-3  # the adapter does change the output
    runtime.activate("transformer", _choice(adapters["a"], "a", 0.0, 4, 8.0))
    assert all(torch.equal(x, y) for x, y in zip(_run(served, inputs), reference, strict=True))
    runtime.activate("transformer", None)
    assert all(torch.equal(x, y) for x, y in zip(_run(served, inputs), reference, strict=True))
    assert runtime.host_bytes() > 0 and len(runtime.device.items) == 2


def test_unfused_projections_get_one_wrapper_each_and_the_same_result(adapters):
    base = _model()
    served = copy.deepcopy(base)
    runtime = LoraRuntime({"transformer": served}, slot_rank=4)
    assert ("transformer_blocks.0.attn.to_k", ("transformer_blocks.0.attn.to_k",)) in wrapped_targets(served)
    runtime.activate("transformer", _choice(adapters["b"], "b", 1.0, 4, 2.0))
    inputs = _inputs()
    merged = _merged(base, adapters["b"], 1.0, 2.0, 4)
    for x, y in zip(_run(served, inputs), _run(merged, inputs), strict=True):
        assert (x - y).abs().max() <= 1e-4


def test_lora_on_fp8_base_weights_equals_the_dequantized_model_merged(adapters):
    quantized = _model()
    quantize_in_place(quantized, "transformer", ComponentQuant(), torch.float32, "weight_only")
    reference = _model()  # the same seeded weights; the test puts each FP8 layer's dequantised weight in place
    with torch.no_grad():
        for name, layer in quantized.named_modules():
            if isinstance(layer, Fp8Linear):
                reference.get_submodule(name).weight.copy_(layer.dequantized_weight())
    served = copy.deepcopy(quantized)
    served.fuse_projections()
    runtime = LoraRuntime({"transformer": served}, slot_rank=4)
    assert served.transformer_blocks[0].attn.to_qkv.lora_a.dtype == torch.float32  # the compute dtype, not FP8
    runtime.activate("transformer", _choice(adapters["a"], "a", 0.7, 4, 8.0))
    inputs = _inputs()
    merged = _merged(reference, adapters["a"], 0.7, 8.0, 4)
    for x, y, r in zip(_run(served, inputs), _run(merged, inputs), _run(quantized, inputs), strict=True):
        assert (x - y).abs().max() <= 1e-4
        assert (x - r).abs().max() > 1e-3


def test_lru_caches_are_bounded(adapters):
    served = _model()
    runtime = LoraRuntime({"transformer": served}, slot_rank=4, max_cpu_loras=1, max_loras=1)
    for name in ("a", "b", "a"):
        runtime.activate("transformer", _choice(adapters[name], name, 1.0, 4, 1.0))
    assert list(runtime.host.items) == [str(adapters["a"])]
    assert list(runtime.device.items) == [("transformer", str(adapters["a"]))]


@pytest.mark.parametrize("max_loras", [1, 2])
def test_the_device_cache_never_holds_more_than_max_loras_adapters(adapters, tmp_path, monkeypatch, max_loras):
    """Defect 7 of issue 29: the device cache built the new adapter before evicting the oldest, so max_loras + 1
    were resident at once. Every upload is tracked by weak references; when one is built, at most max_loras - 1
    earlier ones may still be alive (cache entries or tensors a wrapper still points at)."""
    import gc
    import weakref

    from h3serve.rank import lora

    cfg = dataclasses.asdict(H3TransformerConfig(**SMALL_DIT))
    paths = dict(adapters, c=write_peft_adapter(tmp_path / "c", cfg, rank=4, alpha=4.0, seed=3))
    uploads: list[list[weakref.ref]] = []
    alive_at_build: list[int] = []
    build = lora.device_factors

    def tracked(*args, **kwargs):
        gc.collect()
        alive_at_build.append(sum(1 for refs in uploads if any(r() is not None for r in refs)))
        out = build(*args, **kwargs)
        uploads.append([weakref.ref(t) for pair in out for t in pair])
        return out

    monkeypatch.setattr(lora, "device_factors", tracked)
    served = _model()
    runtime = LoraRuntime({"transformer": served}, slot_rank=4, max_cpu_loras=4, max_loras=max_loras)
    inputs = _inputs()
    for name in ("a", "b", "c", "a", "b"):
        runtime.activate("transformer", _choice(paths[name], name, 1.0, 4, 1.0))
        assert runtime.active["transformer"] == name
        _run(served, inputs)  # the wrappers serve the adapter just activated
    assert len(alive_at_build) == 5  # every switch missed the cache: each one built an adapter
    assert max(alive_at_build) + 1 <= max_loras
    gc.collect()
    assert sum(1 for refs in uploads if any(r() is not None for r in refs)) == max_loras


def test_an_evicted_adapter_still_active_returns_its_dit_to_zero_factors(adapters):
    """With one device slot, activating a second DiT's adapter evicts the first DiT's: that DiT then serves no
    adapter (zero factors, scale 0) rather than keeping the evicted factors resident."""
    first, second = _model(), _model()
    runtime = LoraRuntime({"transformer": first, "transformer_ref": second}, slot_rank=4, max_loras=1)
    inputs = _inputs()
    reference = _run(copy.deepcopy(first), inputs)
    runtime.activate("transformer", _choice(adapters["a"], "a", 1.0, 4, 8.0))
    runtime.activate("transformer_ref", _choice(adapters["b"], "b", 1.0, 4, 2.0))
    assert list(runtime.device.items) == [("transformer_ref", str(adapters["b"]))]
    assert runtime.active == {"transformer": None, "transformer_ref": "b"}
    assert all(torch.equal(x, y) for x, y in zip(_run(first, inputs), reference, strict=True))


@pytest.mark.slow
def test_switching_adapter_or_scale_never_recompiles(adapters):
    torch._dynamo.reset()
    compiles = []

    def backend(gm, example_inputs):
        compiles.append(gm)
        return gm.forward

    served = _model()
    served.fuse_projections()
    runtime = LoraRuntime({"transformer": served}, slot_rank=4)
    compile_transformer(served, "regional", True, CompileState(log=print), backend=backend)
    inputs = _inputs()
    runtime.activate("transformer", None)
    _run(served, inputs)
    first = len(compiles)
    outputs = []
    for name, scale in (("a", 1.0), ("b", 0.5), (None, 0.0), ("a", 2.0)):
        runtime.activate("transformer", None if name is None else _choice(adapters[name], name, scale, 4, 8.0))
        outputs.append(_run(served, inputs)[0])
    assert first == 2 and len(compiles) == first  # main block + refiner block graphs, nothing more
    assert not torch.equal(outputs[0], outputs[3]) and not torch.equal(outputs[0], outputs[1])


def test_taomate_directory_on_native_names_equals_the_native_merge(tmp_path):
    """The real-time LoRA's native factors (fused stacked Q/K/V, [gate; value] fc1) applied unmerged on h3serve's
    diffusers modules equal the test's merge into the native weights converted with the checkpoint key maps."""
    from h3serve.adapters.taomate import WEIGHTS_FILE
    from h3serve.checkpoint.native_names import native_to_diffusers_name
    from h3serve.loading.dit_keys import diffusers_to_native, split_native_tensor
    from h3serve.tools.tiny.make_adapter import write_taomate_adapter

    cfg = dataclasses.asdict(H3TransformerConfig(**SMALL_DIT))
    folder = write_taomate_adapter(tmp_path / "taomate", cfg, rank=4, alpha=6.0, seed=3, std=0.1)
    base = _model()
    heads, head_dim = SMALL_DIT["num_attention_heads"], SMALL_DIT["attention_head_dim"]
    native = diffusers_to_native(base.state_dict(), head_dim, "stacked")
    factors = load_file(str(folder / WEIGHTS_FILE))
    with torch.no_grad():
        for key, a in factors.items():
            if key.endswith(".lora_a"):
                target = key[: -len(".lora_a")]
                native[f"{target}.weight"] = native[f"{target}.weight"] + 6.0 / 4 * (factors[f"{target}.lora_b"] @ a)
    merged = copy.deepcopy(base)
    converted = {
        name: t
        for key, tensor in native.items()
        for name, t in split_native_tensor(native_to_diffusers_name(key), tensor, heads, head_dim, "stacked")
    }
    merged.load_state_dict(converted, strict=False)
    merged.fuse_projections()
    served = copy.deepcopy(base)
    served.fuse_projections()
    runtime = LoraRuntime({"transformer": served}, slot_rank=8)
    runtime.activate("transformer", _choice(folder, "realtime", 1.0, 4, 6.0))
    inputs = _inputs()
    for x, y, r in zip(_run(served, inputs), _run(merged, inputs), _run(base, inputs), strict=True):
        assert (x - y).abs().max() <= 1e-4
        assert (x - r).abs().max() > 1e-3
    runtime.activate("transformer", None)  # off: the base model exactly (the audio teacher's forwards)
    plain = copy.deepcopy(base)
    plain.fuse_projections()
    assert all(torch.equal(x, y) for x, y in zip(_run(served, inputs), _run(plain, inputs), strict=True))
