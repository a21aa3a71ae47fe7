"""The planner counts LoRA bytes: the blocks' slots and the caches it plans are the bytes the runtime allocates
(under offload: tests/rank/test_lora_engine.py)."""

from __future__ import annotations

import copy
import dataclasses

from small_dit import SMALL_DIT

from h3serve.config.engine_config import EngineConfig
from h3serve.config_checks import check_config
from h3serve.model.transformer import H3Transformer, H3TransformerConfig
from h3serve.offload.lora_bytes import ADAPTERS, lora_bytes, slot_elements
from h3serve.offload.plan_report import format_plan
from h3serve.rank.lora import LoraRuntime
from h3serve.rank.placement import plan_for_engine
from h3serve.rules.adapter_choice import AdapterChoice
from h3serve.tools.tiny.make_adapter import write_peft_adapter


def test_planned_bytes_are_the_runtimes_and_shards_divide_them(tmp_path):
    cfg = H3TransformerConfig(**SMALL_DIT)
    dit = H3Transformer(cfg).eval()
    dit.fuse_projections()
    runtime = LoraRuntime({"transformer": copy.deepcopy(dit), "transformer_ref": dit}, slot_rank=6, max_loras=2)
    zero = sum(b.nbytes for name in runtime.dits for w in runtime.dits[name].wrappers for b in (w.lora_a, w.lora_b))
    for seed, name in ((1, "transformer"), (2, "transformer_ref")):
        path = write_peft_adapter(tmp_path / str(seed), dataclasses.asdict(cfg), rank=4, seed=seed)
        runtime.activate(name, AdapterChoice(str(seed), str(path), 1.0, seed, 4, 4.0))
    device, host = lora_bytes({"transformer": cfg, "transformer_ref": cfg}, 6, 1, 4, max_loras=2, max_cpu_loras=3)
    assert zero == 2 * slot_elements(cfg, 6, 1) * 4  # each DiT's blocks hold one slot (in the blocks' bytes)
    assert device == runtime.device_bytes()
    assert host == 3 * slot_elements(cfg, 6, 1) * 4
    assert runtime.host_bytes() == 2 * slot_elements(cfg, 4, 1) * 4  # an adapter in host memory = a slot at its rank
    two = slot_elements(cfg, 6, 2)
    assert slot_elements(cfg, 6, 1) > two > slot_elements(cfg, 6, 1) / 2  # column A and row B stay whole


def test_the_engine_plan_shows_the_adapters(tiny_checkpoint, tmp_path):
    import json

    cfg = json.loads((tiny_checkpoint / "transformer" / "config.json").read_text())
    path = write_peft_adapter(tmp_path / "a", cfg, rank=4)
    config = check_config(
        EngineConfig(model=tiny_checkpoint, device="cpu", lora_paths=(("a", str(path)),), max_loras=3)
    )
    plan = plan_for_engine(config, None)
    stage = plan.ranks[0].stage("denoise")
    without = plan_for_engine(check_config(EngineConfig(model=tiny_checkpoint, device="cpu")), None)
    slot = slot_elements(H3TransformerConfig.from_dict(cfg), 4, 1) * 4
    assert stage.weights[ADAPTERS] == 3 * slot  # 3 cached adapters
    for dit in ("transformer", "transformer_ref"):  # and each DiT's blocks carry a zero slot
        assert stage.weights[dit] - without.ranks[0].stage("denoise").weights[dit] == slot
    assert plan.ranks[0].host_bytes[ADAPTERS] == 4 * slot
    assert "lora adapters weights" in format_plan(plan)
