"""The planner counts a real-time session's clean K/V cache: the bytes a session allocates, per rank (its head
shard), on every stage; a canvas whose cache cannot fit the device is refused before the session starts."""

from __future__ import annotations

import torch

from h3serve.checkpoint.resolver import read_layout
from h3serve.config.engine_config import EngineConfig
from h3serve.loading.components import load_components
from h3serve.model.realtime.causal_session import CausalSession
from h3serve.offload.placement_plan import GiB
from h3serve.offload.plan_report import format_plan
from h3serve.offload.realtime_kv import REALTIME_KV
from h3serve.rank.placement import plan_for_engine, realtime_refusal
from h3serve.rules.validate.realtime_plan import plan_realtime
from h3serve.tools.tiny.make_adapter import make_tiny_adapter


class _NoLora:
    def student(self) -> None: ...
    def base(self) -> None: ...


def test_the_plan_holds_the_bytes_a_session_allocates(tiny_checkpoint, tmp_path):
    lora = str(make_tiny_adapter(tmp_path / "taomate", "taomate"))
    plain = plan_for_engine(EngineConfig(model=tiny_checkpoint, task_type="fl2va"), 64 * GiB)
    config = EngineConfig(model=tiny_checkpoint, task_type="fl2va", realtime_lora=lora)
    components = load_components(read_layout(tiny_checkpoint))
    for width, height in ((480, 864), (64, 64)):
        plan = plan_for_engine(config, 64 * GiB, realtime_size=(width, height))
        session = CausalSession(components, torch.device("cpu"), width, height, 1, 4, _NoLora())
        try:
            measured = session.cache.nbytes
        finally:
            session.close()
        assert all(s.weights[REALTIME_KV] == measured for r in plan.ranks for s in r.stages)
        grown = plan.peak_device_bytes - plain.peak_device_bytes
        assert measured <= grown <= measured + 2 * 2**20  # plus the streaming LoRA's slot (rank 4)
    assert "realtime kv cache weights" in format_plan(plan, "plan")
    halved = plan_for_engine(EngineConfig(model=tiny_checkpoint, task_type="fl2va", realtime_lora=lora,
                                          ulysses_degree=2), None, realtime_size=(64, 64))
    assert halved.ranks[0].stages[0].weights[REALTIME_KV] * 2 == measured


def test_a_canvas_the_device_cannot_hold_is_refused(tiny_checkpoint, tmp_path):
    lora = str(make_tiny_adapter(tmp_path / "taomate", "taomate"))
    config = EngineConfig(model=tiny_checkpoint, task_type="fl2va", realtime_lora=lora)
    small = plan_realtime("x", 64, 64, 1, 10, defaults=read_layout(tiny_checkpoint).defaults())
    large = plan_realtime("x", 1088, 1920, 1, 10)
    assert realtime_refusal(config, small, 3 * GiB // 2) is None
    assert realtime_refusal(config, large, None) is None  # no device size: no verdict
    says = realtime_refusal(config, large, 3 * GiB // 2)  # 1.5 GiB: 0.66 GiB + 1 GiB headroom do not fit
    assert says.startswith("a session at 1088x1920 needs") and "--usp" in says
