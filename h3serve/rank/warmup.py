"""Warm-up: what a first request would pay, paid before the engine reports ready (`serve --warmup`).

A first request after a cold start pays for more than its forwards: torch.compile tracing and code generation of
the DiT's blocks, the kernels' plans (cuBLAS heuristics, cuDNN's benchmarked convolution algorithms for the VAEs'
shapes, oneDNN primitives on a CPU), the caching allocator's first pools, lazily built tables (RoPE, the text
encoder's), and the AdaLN memo of its schedule. Each rank therefore runs, before it says `Ready`:

1. the AdaLN memo of every loaded DiT's default schedule (the steps and shifts a default request runs, keyframe
   and reference rows included), exactly as a request computes it (`h3serve.loading.adaln_sidecar.default_steps`);
2. one T2VA request per --warmup shape, through the same `ModelRunner.generate` a job takes: text encode, every
   compiled graph at that shape, both decodes. `WARMUP_STEPS` forwards are enough (a forward's cost does not change
   after the first), unless an adapter pins the schedule (then its own count).

Every rank runs the same requests in the same order, so the collectives pair up as in a job. What the warm-up ran
is returned (and logged by rank 0), so a test can see each path was taken.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from h3serve.config_checks import warmup_requests
from h3serve.loading.adaln_sidecar import default_steps
from h3serve.model.adaln_memo import memo_key

if TYPE_CHECKING:
    from h3serve.rank.model_runner import ModelRunner

DIT_TASKS = {"transformer": "t2va", "transformer_ref": "ref2va"}


@dataclass
class WarmupReport:
    """What the warm-up ran: per request its shape, steps and stage durations; the memo entries of the default
    schedules; the compiled graphs before and after; the seconds it took."""

    requests: list[dict] = field(default_factory=list)
    memo_entries: dict[str, int] = field(default_factory=dict)  # DiT -> default-schedule entries now in the memo
    graphs: tuple[int, int] = (0, 0)
    seconds: float = 0.0

    def summary(self) -> str:
        shapes = ", ".join(f"{r['width']}x{r['height']}x{r['num_frames']} ({r['steps']} forwards, {r['seconds']:.1f} s)"
                           for r in self.requests)
        memo = ", ".join(f"{dit} {n}" for dit, n in self.memo_entries.items()) or "off"
        return (f"warm-up: {self.seconds:.1f} s; requests {shapes or 'none'}; AdaLN memo entries of the default "
                f"schedules: {memo}; compiled graphs {self.graphs[0]} -> {self.graphs[1]}")


def warm_default_memo(engine: ModelRunner) -> dict[str, int]:
    """The default schedules' AdaLN modulations in the memo (computed where missing, as a request computes them);
    per DiT the number of its default-schedule entries the memo holds. Empty when the memo is off."""
    pipeline = engine.pipeline
    memo = pipeline.sampler.adaln
    if memo is None:
        return {}
    held = {}
    for name in DIT_TASKS:
        model = getattr(pipeline.components, name)
        if model is None:
            continue
        requests = default_steps(name, engine.defaults)
        with pipeline.hooks.request(DIT_TASKS[name]), pipeline.hooks.stage("denoise"):
            for tags, forwards in requests:
                memo.prepare(name, model, forwards, tags, engine.device, pipeline.hooks.weights,
                             adapter=model.adaln_adapter)
        keys = {memo_key(name, model, s, s.slots(tags), model.adaln_adapter) for tags, forwards in requests
                for s in forwards}
        held[name] = sum(memo.get(k) is not None for k in keys)
    return held


def warm_up(engine: ModelRunner, log: Callable[[str], None] | None = None) -> WarmupReport:
    """Run the engine's --warmup (on every rank, in the same order); a request the engine refuses raises."""
    report = WarmupReport()
    start = time.perf_counter()
    graphs = engine.counters()["compiled_graphs"]
    report.memo_entries = warm_default_memo(engine)
    for request in warmup_requests(engine.config, engine.defaults):
        plan = engine.plan(request)
        began = time.perf_counter()
        output = engine.generate(plan)
        report.requests.append({
            "width": plan.width, "height": plan.height, "num_frames": plan.num_frames, "steps": plan.steps,
            "seconds": time.perf_counter() - began, "stages": dict(output.stage_durations),
        })
    report.graphs = (graphs, engine.counters()["compiled_graphs"])
    report.seconds = time.perf_counter() - start
    if log is not None:
        log(report.summary())
    return report
