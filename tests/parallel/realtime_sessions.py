"""What the spawned ranks run for the real-time multi-rank test (importable by the spawned processes)."""

from __future__ import annotations

from pathlib import Path

from realtime_recorder import Recorder

from h3serve.config.engine_config import EngineConfig
from h3serve.rank.model_runner import ModelRunner
from h3serve.rank.realtime_loop import generate_offline
from h3serve.rules.validate.realtime_plan import plan_realtime


def _arrays(engine: ModelRunner, plan) -> tuple:
    recorder = Recorder()
    generate_offline(engine, plan, recorder)
    return recorder.arrays()


def realtime_cases(rank: int, world: int, checkpoint: Path, lora: str, chunks_frames: int) -> dict:
    """Rank 0 runs the one-rank session first (same thread count), then every rank runs it under Ulysses."""

    def config(**overrides) -> EngineConfig:
        return EngineConfig(model=checkpoint, threads=1, task_type="fl2va", realtime_lora=lora, **overrides)

    out = {}
    if rank == 0:
        engine = ModelRunner(config(), 0, 1)
        plan = plan_realtime("a lighthouse in a storm!", 64, 64, 3, chunks_frames, defaults=engine.defaults)
        out["reference"] = _arrays(engine, plan)
        del engine
    engine = ModelRunner(config(num_ranks=world, ulysses_degree=world), rank, world)
    plan = plan_realtime("a lighthouse in a storm!", 64, 64, 3, chunks_frames, defaults=engine.defaults)
    out["ulysses"] = _arrays(engine, plan) if rank == 0 else generate_offline(engine, plan, None)
    out["heads"] = engine.pipeline.components.transformer.config.num_attention_heads // world
    return out
