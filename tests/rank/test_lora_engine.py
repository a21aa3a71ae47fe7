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
from h3serve.config.engine_config import EngineConfig
from h3serve.config.offload_config import OffloadConfig
from h3serve.errors import RequestError
from h3serve.offload.activations import RequestShape
from h3serve.offload.lora_bytes import ADAPTERS
from h3serve.offload.placement_plan import stages_for
from h3serve.offload.runtime import placement_mismatches
from h3serve.rank.model_runner import ModelRunner
from h3serve.rank.placement import plan_for_engine
from h3serve.rules.request import GenerationRequest
from h3serve.tools.tiny.make_adapter import write_peft_adapter


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


SEQUENCE = ("a", None, "b", "a")
SCALES = {"a": 1.0, "b": 0.5}


def _engine(checkpoint, paths, **overrides) -> ModelRunner:
    return ModelRunner(EngineConfig(model=checkpoint, threads=1, task_type="fl2va", lora_paths=paths, **overrides))


def _serve(engine: ModelRunner, catalog: LoraCatalog) -> list:
    """The interleaved requests of SEQUENCE through `engine`: (video, audio) of each."""
    outputs = []
    for name in SEQUENCE:
        lora = None if name is None else catalog.choose(LoraField(name=name, scale=SCALES[name]))
        out = engine.generate(engine.plan(_request(lora)))
        outputs.append((out.video, out.audio))
    return outputs


@pytest.fixture(scope="module")
def resident(tiny_checkpoint, adapters):
    """One resident engine serving both adapters (device cache of 1), and its outputs for SEQUENCE."""
    root, files = adapters
    paths = (("a", str(files["a"].parent)), ("b", str(files["b"].parent)))
    engine = _engine(tiny_checkpoint, paths, max_loras=1)
    catalog = LoraCatalog(
        target_shapes(json.loads((tiny_checkpoint / "transformer" / "config.json").read_text())),
        dict(paths),
        log=lambda s: None,
    )
    return engine, catalog, paths, _serve(engine, catalog)


def test_two_adapters_and_none_interleaved_each_equal_their_reference(tiny_pipeline, adapters, resident):
    _, files = adapters
    engine, catalog, _, outputs = resident
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
    for name, (video, _) in zip(SEQUENCE, outputs, strict=True):
        if name is None:
            assert np.array_equal(video, references[None])
        else:
            assert np.abs(video - references[name]).max() <= 1e-4, name
            assert np.abs(video - references[None]).max() > 1e-2  # the adapter shows
    assert engine.lora.active == {"transformer": "a"} and len(engine.lora.device.items) == 1
    assert engine.lora.loads == {"host": 2, "device": 3}  # a, b read once; the device cache of 1 refilled for a
    assert isinstance(engine.pipeline.components.transformer.transformer_blocks[0].ff.net[2].lora_scale, torch.Tensor)


OFFLOADS = {
    "layerwise": OffloadConfig(streamed=frozenset({"dit"})),
    "cpu_offload": OffloadConfig(staged=frozenset({"dit"})),
    "dlo_rank_local_k2": OffloadConfig(
        streamed=frozenset({"dit"}), distributed=True, transfer="rank-local", resident_layers=2
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("mode", list(OFFLOADS))
def test_factors_stream_with_their_block_bit_for_bit(tiny_checkpoint, resident, mode):
    _, catalog, paths, expected = resident
    engine = _engine(tiny_checkpoint, paths, offload=OFFLOADS[mode], num_ranks=1)
    served = engine.lora.dits["transformer"]
    assert served.offloaded and engine.lora.device.items == {} and engine.offload.owns(served.wrappers[0], "lora_a")
    for (video, audio), (want_video, want_audio) in zip(_serve(engine, catalog), expected, strict=True):
        assert torch.equal(torch.from_numpy(video), torch.from_numpy(want_video))
        assert torch.equal(torch.from_numpy(audio), torch.from_numpy(want_audio))
    assert engine.lora.loads == {"host": 2, "device": 3}  # the blocks' factors rewritten for a, b, a
    # The planner's bytes are what the units carry: each streamed block holds its factors.
    plan = engine.plan(_request())
    shape = RequestShape(plan.width, plan.height, plan.num_frames, plan.task)
    planned = plan_for_engine(engine.config, None, shape).ranks[0]
    assert placement_mismatches(engine.offload.log, planned, stages_for(plan.task)) == []
    assert engine.offload.host_bytes["transformer"] == planned.host_bytes["transformer"]
    assert ADAPTERS not in planned.stage("denoise").weights  # no device cache: the factors ride in the blocks
    assert all(w.lora_a.numel() == 0 for w in served.wrappers)  # released with their blocks after the request


def test_a_merged_adapter_agrees_with_the_unmerged_one_to_fp32_rounding(tiny_checkpoint, resident):
    """--merge-lora: the adapter fused into the weights at load, no wrappers; a request naming no adapter runs it,
    to fp32 rounding of the unmerged engine's output; another adapter or scale is refused with the reason."""
    _, catalog, paths, outputs = resident
    engine = _engine(tiny_checkpoint, paths[:1], merge_lora=True)
    assert engine.lora is None and engine.defaults.merged_lora.name == "a"
    want_video, want_audio = outputs[0]  # "a" at scale 1, unmerged
    for lora in (None, catalog.choose(LoraField(name="a", scale=1.0))):
        out = engine.generate(engine.plan(_request(lora)))
        # Measured on this CPU: video 1.0e-6, audio 1.9e-5 (the audio VAE's gain) of their largest value 1.0.
        assert np.abs(out.video - want_video).max() <= 1e-5
        assert np.abs(out.audio - want_audio).max() <= 1e-4
        assert np.abs(out.video - outputs[1][0]).max() > 1e-2  # unlike the unadapted output
    for lora, field in ((catalog.choose(LoraField(name="b")), "lora"), (catalog.choose(LoraField(name="a", scale=0.5)),
                                                                       "lora.scale")):
        with pytest.raises(RequestError, match="merged the adapter a into its weights") as caught:
            engine.plan(_request(lora))
        assert caught.value.field == field
