"""What the spawned ranks run for the multi-rank offload tests (importable by the spawned processes)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from rank_sessions import plan_for
from read_counter import counting_reads, read_under

from h3serve.adapters.catalog import LoraField
from h3serve.adapters.serving import catalog_for
from h3serve.config.engine_config import EngineConfig
from h3serve.config.offload_config import OffloadConfig
from h3serve.offload.activations import RequestShape
from h3serve.offload.placement_plan import stages_for
from h3serve.offload.runtime import placement_mismatches
from h3serve.rank.model_runner import ModelRunner
from h3serve.rank.placement import plan_for_engine

STAGED = frozenset({"text_encoder", "vae", "audio_vae"})  # what the legacy layerwise flags also stage


def dlo(transfer: str, resident: int = 0) -> OffloadConfig:
    """`--enable-distributed-layerwise-offload [--dlo-no-use-allgather] [--dlo-resident-layers K]`."""
    return OffloadConfig(
        staged=STAGED, streamed=frozenset({"dit"}), distributed=True, transfer=transfer, resident_layers=resident
    )


def _run(checkpoint: Path, rank: int, world: int, layout: dict, offload: OffloadConfig) -> dict:
    config = EngineConfig(model=checkpoint, threads=1, task_type="fl2va", num_ranks=world, offload=offload, **layout)
    with counting_reads() as reads:  # the tensor bytes this rank's load reads from the DiT's files
        engine = ModelRunner(config, rank, world)
    plan = plan_for(engine.defaults)
    if config.lora_paths:  # a layout serving LoRA runs its first adapter
        plan = replace(plan, lora=catalog_for(config).choose(LoraField(name=config.lora_paths[0][0])))
    out = engine.generate(plan)
    runtime = engine.offload
    # This rank's placement, stage by stage, against the planner's plan for this request.
    shape = RequestShape(plan.width, plan.height, plan.num_frames, plan.task)
    planned = plan_for_engine(engine.config, None, shape).ranks[rank]
    return {
        "video": out.video,
        "audio": out.audio,
        "peaks": {stage: dict(peaks) for stage, peaks in runtime.log.peaks.items()},
        "host_bytes": dict(runtime.host_bytes),
        "planned_host_bytes": dict(planned.host_bytes),
        "mismatches": placement_mismatches(runtime.log, planned, stages_for(plan.task)),
        "dit_read": read_under(reads, checkpoint / "transformer"),
    }


def offload_cases(rank: int, world: int, checkpoint: Path, cases: list[tuple[str, dict, OffloadConfig]]) -> dict:
    """Each case's parallel layout without offload (once per layout), then with its offload config."""
    out: dict = {"resident": {}}
    for name, layout, offload in cases:
        key = repr(sorted(layout.items()))
        if key not in out["resident"]:
            out["resident"][key] = _run(checkpoint, rank, world, layout, OffloadConfig())
        out[name] = _run(checkpoint, rank, world, layout, offload) | {"layout_key": key}
    return out
