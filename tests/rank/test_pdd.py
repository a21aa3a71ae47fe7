"""PDD 8-step adapters (Alibaba PAI's `MiniMax-H3-{FL2VA,Ref2VA}-Acc-8Step`) on the tiny checkpoint: the file's
contract checked from its header, and h3serve's served output against the test's own merge, written here from the
release's description (W += alpha/r·up@down on every target, the AdaLN projections included; forward k's heads
the bank's heads 4k..4k+3 weighted by their step on the 32-step shifted grid), on the plain pipeline."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file

from h3serve.adapters.catalog import LoraCatalog, LoraField
from h3serve.adapters.header import AdapterError, read_header
from h3serve.adapters.pdd import inspect_pdd, is_pdd
from h3serve.adapters.peft import target_shapes
from h3serve.config.engine_config import EngineConfig
from h3serve.rank.model_runner import ModelRunner
from h3serve.rules.request import GenerationRequest
from h3serve.rules.validate import RequestError
from h3serve.tools.tiny.make_adapter import save_file, write_pdd_adapter

PROMPT = "a red ball moving left"


def _config(checkpoint) -> dict:
    return json.loads((checkpoint / "transformer" / "config.json").read_text())


@pytest.fixture(scope="module")
def pdd_file(tiny_checkpoint, tmp_path_factory):
    return write_pdd_adapter(tmp_path_factory.mktemp("pdd"), _config(tiny_checkpoint), rank=4, seed=3, std=0.2)


@pytest.fixture(scope="module")
def engine(tiny_checkpoint, pdd_file):
    return ModelRunner(EngineConfig(model=tiny_checkpoint, threads=1, task_type="fl2va",
                                    lora_paths=(("acc", str(pdd_file)),)))


def _choice(checkpoint, pdd_file, **field):
    cfg = _config(checkpoint)
    catalog = LoraCatalog(target_shapes(cfg), {"acc": str(pdd_file)}, log=lambda s: None, dit_config=cfg)
    return catalog.choose(LoraField(name="acc", **field))


# -- the test's own reference ----------------------------------------------------------------------------------


def _grid_weights(shift: float, forward: int) -> torch.Tensor:
    """Forward k's weights over the 32 heads: each head's step of t = 1 - shift·σ/(1 + (shift-1)·σ) on
    σ = linspace(1, 0, 33), over its block of four's whole step."""
    sigma = torch.linspace(1.0, 0.0, 33, dtype=torch.float64)
    t = 1.0 - shift * sigma / (1.0 + (shift - 1.0) * sigma)
    dt = t[1:] - t[:-1]
    w = torch.zeros(32, dtype=torch.float64)
    w[4 * forward : 4 * forward + 4] = dt[4 * forward : 4 * forward + 4] / dt[4 * forward : 4 * forward + 4].sum()
    return w


def _reference(plain, plan, pdd_file):
    """The plain pipeline with the trunk merged and proj_out / audio_proj_out swapped per forward."""
    tensors = load_file(str(pdd_file))
    dit = plain.components.transformer
    original = {k: v.clone() for k, v in dit.state_dict().items()}
    forward = {"k": 0}

    class Head(torch.nn.Module):
        def __init__(self, name: str, shift: float):
            super().__init__()
            self.bank_w, self.bank_b, self.shift = tensors[f"{name}.weight"], tensors[f"{name}.bias"], shift
            self.weight = self.bank_w[0]  # what the forward reads the head's dtype from

        def forward(self, x):
            w = _grid_weights(self.shift, forward["k"]).float()
            return torch.nn.functional.linear(x, torch.einsum("n,noi->oi", w, self.bank_w),
                                              torch.einsum("n,no->o", w, self.bank_b))

    heads = (dit.proj_out, dit.audio_proj_out)
    try:
        with torch.no_grad():
            for key, down in tensors.items():
                if key.endswith(".lora_down"):
                    module = key.removesuffix(".lora_down")
                    dit.get_submodule(module).weight += tensors[f"{module}.lora_up"] @ down  # alpha / r = 1
        dit.proj_out, dit.audio_proj_out = Head("proj_out", 12.0), Head("audio_proj_out", 3.0)
        audio_head = dit.audio_proj_out

        def advance(module, args, output):  # the audio head runs last in a forward
            forward["k"] += 1

        hook = audio_head.register_forward_hook(advance)
        result = plain.generate(plan)
        hook.remove()
        assert forward["k"] == 8
        return result
    finally:
        dit.proj_out, dit.audio_proj_out = heads
        dit.load_state_dict(original)


def test_the_served_output_equals_the_tests_own_merge(tiny_pipeline, tiny_checkpoint, pdd_file, engine):
    plain, _ = tiny_pipeline
    choice = _choice(tiny_checkpoint, pdd_file)
    assert choice.pdd is not None and choice.pdd.forwards == 8 and choice.pdd.tasks == ("t2va", "fl2va")
    plan = engine.plan(GenerationRequest(prompt=PROMPT, duration_s=4, seed=2, lora=choice))
    assert (plan.steps, plan.flow_shift, plan.audio_flow_shift) == (8, 12.0, 3.0)
    engine.lora.activate_for(plan)  # what ModelRunner.generate does first; the pipeline's result keeps the latents
    served = engine.pipeline.generate(plan)
    reference = _reference(plain, plan, pdd_file)
    assert (served.video_latents - reference.video_latents).abs().max() <= 1e-5
    assert (served.audio_latents - reference.audio_latents).abs().max() <= 1e-4
    assert engine.pipeline.components.transformer.adaln_adapter == str(pdd_file)
    # The next request without it is the base model again: heads and AdaLN identity cleared.
    base_plan = engine.plan(GenerationRequest(prompt=PROMPT, duration_s=4, seed=2, steps=8))
    engine.lora.activate_for(base_plan)
    dit = engine.pipeline.components.transformer
    assert dit.step_heads is None and dit.adaln_adapter == ""
    base = engine.pipeline.generate(base_plan)
    assert (served.video_latents - base.video_latents).abs().max() > 0.05  # the adapter shows
    assert torch.equal(base.video_latents, plain.generate(base_plan).video_latents)  # and leaves nothing behind


def test_requests_outside_its_contract_are_refused_by_name(tiny_checkpoint, pdd_file, engine):
    choice = _choice(tiny_checkpoint, pdd_file)
    base = GenerationRequest(prompt=PROMPT, duration_s=4, lora=choice)
    for change, field in (({"steps": 4}, "steps"), ({"flow_shift": 5.0}, "flow_shift"),
                          ({"audio_flow_shift": 5.0}, "audio_flow_shift"),
                          ({"sample_solver": "res_multistep"}, "sample_solver")):
        with pytest.raises(RequestError) as e:
            engine.plan(GenerationRequest(**{**vars(base), **change}))
        assert e.value.field == field and "PDD adapter acc" in str(e.value)
    with pytest.raises(RequestError, match="scale 1 only") as e:
        engine.plan(GenerationRequest(**{**vars(base), "lora": _choice(tiny_checkpoint, pdd_file, scale=0.5)}))
    assert e.value.field == "lora.scale"
    assert engine.plan(GenerationRequest(**{**vars(base), "steps": 8})).steps == 8  # restating it is fine


def test_the_files_contract_is_checked_from_its_header(tiny_checkpoint, pdd_file, tmp_path):
    cfg = _config(tiny_checkpoint)
    header = read_header(pdd_file)
    assert is_pdd(header) and pdd_file.name == "MiniMax-H3-FL2VA-Acc-8Step.safetensors"
    info = inspect_pdd(header, cfg)
    assert (info.lora.rank, info.lora.alpha, info.contract.variant) == (4, 4.0, "fl2va")
    blocks = cfg["num_layers"] * 7 + cfg["num_refiner_layers"] * 6
    assert len(header.tensors) == 2 * blocks + 4  # the release's 728 at 50 + 2 blocks
    tensors = load_file(str(pdd_file))
    metadata = dict(header.metadata)

    def refused(name: str, change, meta=metadata) -> str:
        changed = dict(tensors)
        change(changed)
        path = tmp_path / name
        save_file(changed, str(path), meta)
        with pytest.raises(AdapterError) as e:
            inspect_pdd(read_header(path), cfg)
        return str(e.value)

    first = "transformer_blocks.0.adaln_proj.linear"
    assert f"lacks {first}.lora_up" in refused("a.safetensors", lambda t: t.pop(f"{first}.lora_up"))
    assert "'extra.lora_down'" in refused("b.safetensors", lambda t: t.update({"extra.lora_down": torch.zeros(4, 4)}))
    assert "proj_out.bias has shape [32, 95]" in refused(
        "c.safetensors", lambda t: t.update({"proj_out.bias": torch.zeros(32, 95)}))
    assert f"'{first}.lora_down' has shape" in refused(
        "d.safetensors", lambda t: t.update({f"{first}.lora_down": torch.zeros(4, 7)}))
    no_format = {k: v for k, v in metadata.items() if k != "key_format"}
    assert "must say which DiT" in refused("e.safetensors", lambda t: None, no_format)
    # Without key_format the released name decides; with a foreign one it is refused.
    named = tmp_path / "MiniMax-H3-Ref2VA-Acc-8Step.safetensors"
    save_file(tensors, str(named), no_format)
    assert inspect_pdd(read_header(named), cfg).contract.tasks == ("ref2va",)
    assert "key_format 'other'" in refused("f.safetensors", lambda t: None, {**metadata, "key_format": "other"})


def test_a_ref2va_file_refuses_t2va_and_a_plain_lora_is_not_pdd(tiny_checkpoint, tmp_path, engine):
    cfg = _config(tiny_checkpoint)
    ref = write_pdd_adapter(tmp_path / "ref", cfg, variant="ref2va")
    catalog = LoraCatalog(target_shapes(cfg), {"ref": str(ref)}, log=lambda s: None, dit_config=cfg)
    with pytest.raises(RequestError, match="serves ref2va, not t2va") as e:
        engine.plan(GenerationRequest(prompt=PROMPT, duration_s=4, lora=catalog.choose(LoraField(name="ref"))))
    assert e.value.field == "lora"
    assert math.isclose(sum(_grid_weights(12.0, 3)), 1.0)


def test_an_engine_with_its_dit_offloaded_refuses_a_pdd_request_by_name(tiny_checkpoint, pdd_file):
    """Layerwise offload streams each block's AdaLN projection with it: the AdaLN factors are not placed, so the
    request is refused (as the client's error naming `lora`), and plain requests still run."""
    from h3serve.config.offload_config import OffloadConfig

    engine = ModelRunner(EngineConfig(model=tiny_checkpoint, threads=1, task_type="fl2va",
                                      offload=OffloadConfig(streamed=frozenset({"dit"})),
                                      lora_paths=(("acc", str(pdd_file)),)))
    plan = engine.plan(GenerationRequest(prompt=PROMPT, duration_s=4, lora=_choice(tiny_checkpoint, pdd_file)))
    with pytest.raises(RequestError, match="PDD adapter, which this server cannot run") as e:
        engine.generate(plan)
    assert e.value.field == "lora"
    assert engine.generate(engine.plan(GenerationRequest(prompt=PROMPT, duration_s=4, steps=1))).video is not None


def test_the_released_size_is_728_tensors_of_the_documented_shapes(tmp_path):
    """The full-size DiT (50 + 2 blocks, hidden 5,376, time embedding 2,688): a header-only file of the release's
    728 tensors at rank 64 passes the check; the AdaLN factor is [64, 2688] / [96768, 64], the bank [32, 96, 5376]."""
    import dataclasses as dc
    import struct

    from h3serve.adapters.pdd import pdd_target_shapes
    from h3serve.model.transformer_config import H3TransformerConfig

    cfg = dc.asdict(H3TransformerConfig())
    shapes = {f"{t}.lora_down": [64, i] for t, (_, i) in pdd_target_shapes(cfg).items()}
    shapes |= {f"{t}.lora_up": [o, 64] for t, (o, _) in pdd_target_shapes(cfg).items()}
    shapes |= {"proj_out.weight": [32, 96, 5376], "proj_out.bias": [32, 96],
               "audio_proj_out.weight": [32, 32, 5376], "audio_proj_out.bias": [32, 32]}
    header = {k: {"dtype": "F32", "shape": v, "data_offsets": [0, 0]} for k, v in shapes.items()}
    header["__metadata__"] = {"lora_rank": "64", "lora_alpha": "64"}
    path = tmp_path / "MiniMax-H3-Ref2VA-Acc-8Step.safetensors"
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text)  # the header alone: nothing is read past it
    info = inspect_pdd(read_header(path), cfg)
    assert len(shapes) == 728 and info.contract.tasks == ("ref2va",) and info.lora.rank == 64
    assert shapes["transformer_blocks.49.adaln_proj.linear.lora_down"] == [64, 2688]
    assert shapes["transformer_blocks.49.adaln_proj.linear.lora_up"] == [96768, 64]
