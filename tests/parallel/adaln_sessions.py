"""What the spawned ranks run for the multi-rank AdaLN test (importable by the spawned processes)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from offload_sessions import dlo
from rank_sessions import plan_for

from h3serve.config.engine_config import EngineConfig
from h3serve.config.offload_config import OffloadConfig
from h3serve.loading.adaln_sidecar import load_sidecars
from h3serve.media.mp4 import write_mp4
from h3serve.rank.model_runner import ModelRunner

ADALN_HOST = OffloadConfig(adaln=True)  # the DiT resident, its AdaLN projections in host memory


def _run(checkpoint: Path, rank: int, world: int, layout: dict, sidecars: Path | None = None, **config) -> dict:
    engine = ModelRunner(EngineConfig(model=checkpoint, threads=1, task_type="fl2va", num_ranks=world, **layout,
                                      **config), rank, world)  # fmt: skip
    memo, outcomes = engine.pipeline.sampler.adaln, {}
    plan = plan_for(engine.defaults)
    if sidecars is not None:  # the sidecars hold plan_for's schedule (an engine's start-up: the default request's)
        outcomes = load_sidecars(engine.pipeline, memo, sidecars, engine.defaults, rank, world, print, plan.steps)
    out = engine.generate(plan)
    return {
        "video": out.video,
        "audio": out.audio,
        "sidecars": outcomes,
        "misses": None if memo is None else memo.misses,
        "adaln_host": dict(engine.offload.host_bytes).get("adaln", 0),
    }


def adaln_cases(rank: int, world: int, checkpoint: Path, folder: Path) -> dict:
    """Memo off (the reference) against memo on with the projections on the device or in host memory, a sidecar
    miss and a hit, under TP2, Ulysses 2 and rank-local DLO."""
    tp2, u2 = {"tensor_parallel_size": 2}, {"ulysses_degree": 2}
    out = {
        "tp2_off": _run(checkpoint, rank, world, tp2, adaln_memo_bytes=None),
        "tp2_host_miss": _run(checkpoint, rank, world, tp2, folder / "tp2", offload=ADALN_HOST),
        "tp2_device_hit": _run(checkpoint, rank, world, tp2, folder / "tp2"),
        "dlo_tp2": _run(checkpoint, rank, world, tp2, offload=replace(dlo("rank-local", 1), staged=frozenset())),
        "u2_off": _run(checkpoint, rank, world, u2, adaln_memo_bytes=None),
        "u2_host_miss": _run(checkpoint, rank, world, u2, folder / "u2", offload=ADALN_HOST),
    }
    if rank == 0:
        for name in ("tp2_off", "tp2_device_hit"):
            write_mp4(folder / f"{name}.mp4", out[name]["video"], out[name]["audio"])
            out[name]["mp4"] = (folder / f"{name}.mp4").read_bytes()
    return out
