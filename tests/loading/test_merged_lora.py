"""--merge-lora: a LoRA adapter fused into the DiT's weights at load. The fused weights are the fp32 arithmetic
W + s·alpha/r·B@A (each tensor-parallel shard its cut of it); a DiT forward on them agrees with the unmerged wrapper
to fp32 rounding (the bound measured: docs/benchmarks.md); the flags that cannot go with it are refused at start-up
and a request for another adapter or scale is refused with the reason."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from small_dit import SMALL_DIT, random_small_dit
from small_dit import small_dit_inputs as _inputs
from small_dit import small_dit_outputs as _run

from h3serve.adapters.catalog import lora_file
from h3serve.adapters.peft import target_shapes
from h3serve.adapters.weight_edits import lora_edits
from h3serve.config.engine_config import EngineConfig
from h3serve.config_checks import check_config
from h3serve.errors import ConfigError, RequestError
from h3serve.loading.components import load_transformer
from h3serve.model.transformer import H3Transformer, H3TransformerConfig
from h3serve.parallel.tensor_parallel import TensorParallel
from h3serve.rank.lora import LoraRuntime
from h3serve.rules.adapter_choice import AdapterChoice, TurboContract, merged_choice
from h3serve.rules.defaults import ModelDefaults
from h3serve.rules.request import GenerationRequest
from h3serve.rules.validate import validate
from h3serve.tools.tiny.make_adapter import write_pdd_adapter, write_peft_adapter, write_taomate_adapter

CFG = dataclasses.asdict(H3TransformerConfig(**SMALL_DIT))
EPS = torch.finfo(torch.float32).eps
# Measured over 6 adapters x 2 scales x 2 inputs: merged vs unmerged at most 2.6 eps of the output's largest value,
# each of them within 3.1 eps of the fp64 forward. The bound kept here leaves room for other CPUs' kernels.
BOUND = 8 * EPS


@pytest.fixture(scope="module")
def dit_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("merge") / "transformer"
    folder.mkdir()
    model = random_small_dit()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(SMALL_DIT))
    return folder


def _edits(path, scale: float):
    return lora_edits(lora_file(path, target_shapes(CFG)), scale)


@pytest.mark.parametrize(("seed", "scale", "std"), [(1, 1.0, 0.05), (2, 0.7, 0.3)])
def test_a_merged_forward_agrees_with_the_unmerged_one_to_fp32_rounding(dit_folder, tmp_path, seed, scale, std):
    path = write_peft_adapter(tmp_path / "a", CFG, rank=4, alpha=8.0, seed=seed, std=std)
    merged = load_transformer(dit_folder, merged=_edits(path, scale))
    truth = load_transformer(dit_folder, dtype=torch.float64, merged=_edits(path, scale))
    unmerged = load_transformer(dit_folder)
    for model in (merged, truth, unmerged):
        model.fuse_projections()
    LoraRuntime({"transformer": unmerged}, slot_rank=4).activate(
        "transformer", AdapterChoice("a", str(path), scale, 1, 4, 8.0)
    )
    plain = load_transformer(dit_folder)
    for inputs in (_inputs(seed=0), _inputs(frames=3, seed=1)):
        wide = tuple(x.double() if torch.is_tensor(x) and x.is_floating_point() else x for x in inputs)
        for m, u, t, p in zip(_run(merged, inputs), _run(unmerged, inputs), _run(truth, wide), _run(plain, inputs),
                              strict=True):
            top = t.abs().max()
            assert (m - u).abs().max() <= BOUND * top
            assert (m.double() - t).abs().max() <= BOUND * top  # the merged forward is as exact as the unmerged
            assert (p - u).abs().max() > 1e3 * BOUND * top  # the adapter shows


def test_fused_weights_are_the_fp32_arithmetic_and_each_shard_its_cut(dit_folder, tmp_path):
    path = write_peft_adapter(tmp_path / "a", CFG, rank=3, alpha=6.0, seed=3, std=0.2)
    base, factors = load_file(str(dit_folder / "model.safetensors")), load_file(str(path))
    scale = 0.5 * 6.0 / 3
    whole = load_transformer(dit_folder, merged=_edits(path, 0.5)).state_dict()
    changed = 0
    for name, tensor in base.items():
        key_a = f"{name.removesuffix('.weight')}.lora_A.weight"
        if key_a in factors:
            b = factors[key_a.replace(".lora_A.", ".lora_B.")]
            want = tensor + (b @ factors[key_a]).mul_(scale)
            changed += 1
        else:
            want = tensor
        assert torch.equal(whole[name], want), name
    assert changed == 6 * 3  # q, k, v, out, ff in and ff out of 2 blocks and 1 refiner block
    plan = H3Transformer.tensor_parallel_plan
    for rank in (0, 1):
        tp = TensorParallel(rank, 2, None, plan)
        shard = load_transformer(dit_folder, tp=tp, merged=_edits(path, 0.5)).state_dict()
        for name, tensor in shard.items():
            assert torch.equal(tensor, tp.cut(name, whole[name])), (rank, name)


def _config(checkpoint, **fields) -> EngineConfig:
    return EngineConfig(model=checkpoint, task_type="fl2va", **fields)


def test_start_up_refuses_what_cannot_go_with_a_merged_adapter(tiny_checkpoint, tmp_path):
    cfg = json.loads((tiny_checkpoint / "transformer" / "config.json").read_text())
    one = str(write_peft_adapter(tmp_path / "one", cfg).parent)
    two = str(write_peft_adapter(tmp_path / "two", cfg, seed=2).parent)
    check_config(_config(tiny_checkpoint, lora_paths=(("one", one),), merge_lora=True))
    taomate = str(write_taomate_adapter(tmp_path / "taomate", cfg))
    pdd = str(write_pdd_adapter(tmp_path / "pdd", cfg))
    cases = {
        "exactly one --lora-path": {"lora_paths": (("one", one), ("two", two))},
        "and no --lora-dir": {"lora_paths": (("one", one),), "lora_dir": str(tmp_path)},
        "change every session's weights": {"lora_paths": (("one", one),), "realtime_lora": taomate},
        "streaming LoRA serves real-time sessions": {"lora_paths": (("rt", taomate),)},
        "swaps the DiT's output heads": {"lora_paths": (("pdd", pdd),)},
    }
    for reason, fields in cases.items():
        with pytest.raises(ConfigError, match=reason):
            check_config(_config(tiny_checkpoint, merge_lora=True, **fields))
    with pytest.raises(ConfigError, match="give exactly one"):
        check_config(_config(tiny_checkpoint, merge_lora=True))


def test_a_request_for_another_adapter_scale_or_task_is_refused_with_the_reason():
    turbo = TurboContract("minimax_h3_fl2v_turbo_4step_v1.0.safetensors", "fl2v", 4, "1.0", 12.0)
    merged = AdapterChoice("turbo", "/a/turbo.safetensors", 1.0, 7, 8, 8.0, turbo)
    assert merged_choice(merged, None, "t2va") is merged
    plan = validate(GenerationRequest(prompt="a fox"), ModelDefaults(merged_lora=merged))
    assert plan.lora is merged and plan.steps == 4 and plan.flow_shift == 12.0  # the Turbo contract's schedule
    assert merged_choice(merged, dataclasses.replace(merged, int_id=3), "fl2va") is merged
    refusals = [
        (dataclasses.replace(merged, name="other", path="/a/other.safetensors"), "t2va", "lora", "only, not other"),
        (dataclasses.replace(merged, scale=0.5), "t2va", "lora.scale", "cannot run scale 0.5"),
        (None, "ref2va", "task", "serves t2va, fl2va only, not ref2va"),
    ]
    for asked, task, field, reason in refusals:
        with pytest.raises(RequestError, match=reason) as caught:
            merged_choice(merged, asked, task)
        assert caught.value.field == field
