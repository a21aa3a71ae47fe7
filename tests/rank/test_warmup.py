"""--warmup: before an engine says Ready, each rank runs the default schedule's AdaLN memo and one request per shape
through every stage, compiling the DiT; the first request afterwards compiles nothing and finds its memo. Not a
timing test: the first-vs-second figure is a bench row (docs/benchmarks.md)."""

from __future__ import annotations

import pytest
import torch

from h3serve.config.engine_config import WARMUP_STEPS, EngineConfig, warmup_shapes
from h3serve.config_checks import check_config, warmup_requests
from h3serve.errors import ConfigError
from h3serve.loading.adaln_sidecar import default_steps
from h3serve.messages import Fatal, Ready, Stop
from h3serve.model.adaln_memo import memo_key
from h3serve.rank import worker
from h3serve.rank.model_runner import ModelRunner
from h3serve.rank.warmup import warm_up
from h3serve.rules.adapter_choice import AdapterChoice, TurboContract
from h3serve.rules.defaults import ModelDefaults
from h3serve.rules.request import GenerationRequest

SHAPE = "64x32x97"


def _config(checkpoint, **fields) -> EngineConfig:
    return EngineConfig(model=checkpoint, threads=1, task_type="fl2va", **fields)


def test_the_warm_up_runs_every_path_and_the_first_request_compiles_nothing(tiny_checkpoint):
    # Dynamo capture only (the eager backend): the graphs are built and counted, without inductor's C++ build.
    engine = ModelRunner(_config(tiny_checkpoint, warmup=(SHAPE,), compile_granularity="regional",
                                 compile_backend="eager"))
    # Dynamo's graph counter is the process's: a test before this one in the worker may have compiled. Nothing
    # compiles at load (the first forward would), so the warm-up starts from what the engine found.
    start = engine.counters()["compiled_graphs"]
    lines: list[str] = []
    report = warm_up(engine, lines.append)
    [ran] = report.requests
    assert (ran["width"], ran["height"], ran["num_frames"], ran["steps"]) == (64, 32, 107, WARMUP_STEPS)
    assert {"text_encode", "denoise", "video_decode", "audio_decode"} <= set(ran["stages"])
    before, after = report.graphs
    assert before == start < after
    dit = engine.pipeline.components.transformer
    memo = engine.pipeline.sampler.adaln
    keys = {memo_key("transformer", dit, s, s.slots(tags)) for tags, forwards in default_steps("transformer",
                                                                                             engine.defaults)
            for s in forwards}
    assert report.memo_entries == {"transformer": len(keys)} and all(memo.get(k) is not None for k in keys)
    assert lines == [report.summary()] and f"compiled graphs {start} -> " in lines[0]
    plan = engine.plan(GenerationRequest(prompt="a fox", width=64, height=32, num_frames=97, steps=2, seed=4))
    engine.generate(plan)
    assert engine.counters()["compiled_graphs"] == after  # the first request built no graph


class _Requests:
    def get(self, timeout=None):
        return Stop()


class _Exit(Exception):
    pass


@pytest.mark.parametrize("fails", [False, True])
def test_the_worker_says_ready_only_after_the_warm_up(monkeypatch, fails):
    order: list[str] = []
    engine = type("Engine", (), {"device": torch.device("cpu"), "defaults": ModelDefaults(), "tasks": ("t2va",),
                                 "config": EngineConfig(model="unused", warmup=("default",))})()

    def warm(e, log):
        order.append("warm-up")
        if fails:
            raise RuntimeError("out of memory")

    monkeypatch.setattr(worker, "_start", lambda *args: (engine, None))
    monkeypatch.setattr(worker, "warm_up", warm)
    monkeypatch.setattr(worker.os, "_exit", lambda code: (_ for _ in ()).throw(_Exit(code)))
    events = type("Events", (), {"put": lambda self, event: order.append(event)})()
    with pytest.raises(_Exit if not fails else SystemExit):
        worker.worker_main(0, 1, "unused://", engine.config, _Requests(), events, None)
    assert order[0] == "warm-up"
    if fails:
        assert len(order) == 2 and isinstance(order[1], Fatal) and "warm-up failed" in order[1].message
    else:
        assert isinstance(order[1], Ready)


def test_warm_up_shapes_are_checked_at_start_up(tiny_checkpoint):
    assert warmup_shapes(None) == warmup_shapes("off") == ()
    assert warmup_shapes("default, 64x32x97") == ("default", SHAPE)
    config = check_config(_config(tiny_checkpoint, warmup=("default", SHAPE)))
    assert [r.steps for r in warmup_requests(config, ModelDefaults())] == [WARMUP_STEPS, WARMUP_STEPS]
    turbo = TurboContract("minimax_h3_fl2v_turbo_4step_v1.0.safetensors", "fl2v", 4, "1.0", 12.0)
    merged = AdapterChoice("turbo", "/a/turbo.safetensors", 1.0, 7, 8, 8.0, turbo)
    pinned = warmup_requests(_config(tiny_checkpoint, warmup=("default",)), ModelDefaults(merged_lora=merged))
    assert pinned[0].steps is None  # the adapter's own count
    for shapes, reason in (((SHAPE.replace("x97", ""),), "expected default, off or WIDTHxHEIGHTxFRAMES"),
                           (("64x32x5",), "--warmup 64x32x5: num_frames: must be between")):
        with pytest.raises(ConfigError, match=reason):
            check_config(_config(tiny_checkpoint, warmup=shapes))
    with pytest.raises(ConfigError, match="only the Ref2VA DiT"):
        check_config(EngineConfig(model=tiny_checkpoint, task_type="ref2va", warmup=("default",)))
