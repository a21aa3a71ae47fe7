"""`h3serve bench --gpu-acceptance`: the first command to run when a GPU is available. Within 9⅓ minutes on one
H200 it runs the selftest and every row `docs/benchmarks.md` § GPU waits for, writes a JSON and that section's
table, and says "skipped: <why>" for a row that cannot run here (on CPU: "skipped: no GPU").

Every row is an existing command run as a child process (`h3serve selftest`, `h3serve bench --dit-forward`,
`h3serve bench --matrix`, `h3serve make-tiny-checkpoint`) or the planner in this process, so what it measures is
what those commands measure. Each row has a time budget (the child is killed past it) and starts only if the
global budget still holds its budget; the whole command stays within `--budget-s` (default 560 s).

Rows (GPU sizes):
  selftest              `h3serve selftest` with its default flags on this device (CPU: its reduced width).
  dit_forward           4 released-width blocks at 1344x768x124, 128 text rows: bf16 and FP8 (per channel) eager
                        step time against diffusers, MFU against the same run's GEMM peak.
  plan.fl2va_32gib      the planner: released FL2VA 1344x768, 5 s, FP8, AdaLN + encoder + VAEs on the host, on
                        one 32 GiB GPU (runs on CPU too: the planner needs no device).
  checkpoint            the `gpu-accept` preset (the released DiT width, 2 blocks + 1 refiner) and a Turbo adapter.
  full_depth            `h3serve bench --full-depth`: the released DiT at full depth (random bf16 weights made on the
                        device, no file), the text encoder and VAEs released where they fit beside it (else the
                        checkpoint's tiny ones, said so); a Turbo-4 T2VA 1344x768x124 request after the warm-up:
                        its timeline, the full-depth forward's MFU, the time outside the forwards, x264 vs NVENC.
  offload_modes         T2VA 1344x768x124, 4 steps on `gpu-accept`: resident, AdaLN on the host, layerwise, CPU
                        offload: allocator peak against the plan of each.
  adaln_host_vs_device  from offload_modes' records: denoise step time and peak, AdaLN on the host vs on the device.
  turbo_4_vs_50         832x480x124 on `gpu-accept`: a 4-forward Turbo request against the 50-forward base.
  fl2va_32gib.measured  the plan.fl2va_32gib configuration on `gpu-accept` (FL2VA 1344x768x124, 2 steps): its
                        allocator peak against its plan; the released plan corrected by that error.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from h3serve.tools.verdicts import CheckFailed, Skip

GLOBAL_BUDGET_S = 560.0  # the rows' budgets as measured on one H200 (ROWS); the first plan of 8 minutes held too little
SCHEMA = "h3serve.gpu-acceptance/1"
PASS, FAIL, SKIP = "pass", "fail", "skipped"
PEAK_MARGIN = 0.10  # the selftest's: a measured allocator peak above plan x 1.10 means the planner under-promises
GPU_PRESET = "gpu-accept"
FULL = "1344x768x124"  # the released default canvas, 5 s
FL2VA_OFFLOAD = {"mode": "layer", "components": ["adaln", "text_encoder", "vae", "audio_vae"]}
OFFLOAD_ENGINES = {  # name -> engine options beyond device and dtype (one bench worker each)
    "resident": {},
    "adaln-host": {"offload": {"mode": "layer", "components": ["adaln"]}},
    "layerwise": {"offload": {"mode": "layer", "components": ["dit"]}},
    "cpu-offload": {"offload": {"mode": "module", "components": ["dit", "text_encoder", "vae", "audio_vae"]}},
}


@dataclass
class RowResult:
    name: str
    what: str  # the docs' GPU row it answers
    status: str
    budget_s: float
    seconds: float = 0.0
    figure: str = ""
    message: str = ""  # fail: what went wrong; skipped: why
    data: dict = field(default_factory=dict)


@dataclass
class AcceptanceContext:
    """What every row reads: the device kind, the work folder, the budgets, and what earlier rows left."""

    cuda: bool
    device_name: str
    out: Path
    budget_s: float
    selftest_only: tuple[str, ...] = ()
    log: Callable[[str], None] = lambda line: None
    # `h3serve plan ARGV`'s plan (h3serve.entrypoints.plan.plan_from_argv): the planner rows' figures.
    plan_from_argv: Callable[[list[str]], Any] | None = None
    started: float = field(default_factory=time.perf_counter)
    shared: dict = field(default_factory=dict)

    def left_s(self) -> float:
        return self.budget_s - (time.perf_counter() - self.started)

    def gpu(self) -> None:
        if not self.cuda:
            raise Skip("no GPU")


@dataclass(frozen=True)
class Row:
    name: str
    what: str
    budget_s: float
    run: Callable[[AcceptanceContext, float], tuple[str, dict]]


# ------------------------------------------------------------------------------------------------------------
# Child processes: the existing commands, killed at their budget
def h3serve(argv: list[str], timeout_s: float, log: Callable[[str], None]) -> str:
    """Run `h3serve ARGV` in a child process group; its output's tail. CheckFailed on a non-zero exit or past
    `timeout_s` (the whole group is killed: bench workers and selftest ranks go with it)."""
    code = "import sys; from h3serve.entrypoints.cli import main; sys.exit(main(sys.argv[1:]))"
    log(f"[gpu-acceptance] h3serve {' '.join(argv)}")
    proc = subprocess.Popen([sys.executable, "-c", code, *argv], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=max(1.0, timeout_s))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()  # everything the child printed before it was killed
        raise CheckFailed(f"over its budget of {timeout_s:.0f} s (killed): h3serve {' '.join(argv[:2])}; "
                     f"its last output: {_last_line(out)}") from None
    tail = out[-2000:]
    if proc.returncode not in (0, 1):  # selftest exits 1 on a failed check: its JSON says which
        raise CheckFailed(f"h3serve {argv[0]} exited {proc.returncode}: {_last_line(tail)}")
    return tail


def _last_line(output: str | None) -> str:
    """The last non-blank line a child printed (where it was when it failed or was killed)."""
    lines = [line.strip() for line in (output or "").splitlines() if line.strip()]
    return lines[-1][-300:] if lines else "no output"


def _records(folder: Path) -> list[dict]:
    """The measured runs of a `h3serve bench --matrix` output folder."""
    lines = (folder / "runs.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, filter(None, lines)) if r["phase"] == "measured" and r["side"] == "h3serve"]


def _engine(name: str, **options: Any) -> dict:
    """A request row's engine: eager. These rows measure allocator peaks against plans and step-time ratios; on the
    first H200 run a compiled engine spent 6.5 s in its first forward of four (then 0.24 s each) and 18 of its 30 s
    request in the denoise stage, so a one-run row mostly timed the compile. The compile is the selftest's check."""
    return {"name": name, "device": "cuda", "dtype": "bfloat16", "enforce_eager": True, **options}


def matrix_bodies(checkpoint: str, adapter: str) -> dict[str, dict]:
    """The `h3serve bench --matrix` file of each request row (one measured run, no warm-up: the peaks and step
    times, not a distribution; the GEMM peak kept short)."""
    common = {"model": checkpoint, "seed": 0, "warmup": 0, "runs": 1, "gemm_seconds": 0.5}
    turbo = _engine("turbo-4", lora_paths=[f"turbo={adapter}"], lora="turbo")
    return {
        "offload_modes": {**common, "tasks": ["t2va"], "shapes": [FULL], "steps": 4,
                          "engines": [_engine(name, **options) for name, options in OFFLOAD_ENGINES.items()]},
        "turbo": {**common, "tasks": ["t2va"], "shapes": ["832x480x124"], "steps": 50,
                  "engines": [_engine("base-50"), turbo]},
        "fl2va_32gib": {**common, "tasks": ["fl2va"], "shapes": [FULL], "steps": 2,
                        "engines": [_engine("fl2va-32gib", quantization="fp8", offload=FL2VA_OFFLOAD)]},
    }


def _matrix(ctx: AcceptanceContext, name: str, timeout_s: float) -> list[dict]:
    folder = ctx.out / name
    path = ctx.out / f"{name}.json"  # JSON is YAML: the matrix file format, no YAML writer needed
    body = matrix_bodies(ctx.shared["checkpoint"], ctx.shared.get("turbo", ""))[name]
    path.write_text(json.dumps(body, indent=1))
    h3serve(["bench", "--matrix", str(path), "--out", str(folder)], timeout_s, ctx.log)
    return _records(folder)


# ------------------------------------------------------------------------------------------------------------
# Rows
def selftest(ctx: AcceptanceContext, budget_s: float) -> tuple[str, dict]:
    path = ctx.out / "selftest.json"
    argv = ["selftest", "--device", "cuda" if ctx.cuda else "cpu", "--budget-s", f"{budget_s * 0.9:.0f}",
            "--json", str(path)]
    for prefix in ctx.selftest_only:
        argv += ["--only", prefix]
    tail = h3serve(argv, budget_s, ctx.log)
    outcomes = json.loads(path.read_text())
    verdict = next((line for line in reversed(tail.splitlines()) if line.startswith("verdict:")), "verdict: ?")
    failed = [o["name"] for o in outcomes if o["status"] == FAIL]
    if failed:
        raise CheckFailed(f"{verdict} (see selftest.json)")
    return verdict.removeprefix("verdict: "), {"outcomes": outcomes}


def dit_forward(ctx: AcceptanceContext, budget_s: float) -> tuple[str, dict]:
    ctx.gpu()
    folder = ctx.out / "dit_forward"
    h3serve(["bench", "--dit-forward", "--dit-layers", "4", "--shape", FULL, "--text-rows", "128",
             "--engine", "device=cuda,dtype=bfloat16,quantization=per_channel", "--dit-modes", "eager",
             "--warmup", "1", "--runs", "3", "--gemm-seconds", "1", "--out", str(folder)], budget_s, ctx.log)
    record = json.loads((folder / "dit_forward.json").read_text())
    variants = {}
    for v in record["variants"]:
        best = min(v["times"])
        variants[v["name"]] = {"median_s": sorted(v["times"])[len(v["times"]) // 2], "best_s": best,
                               "mfu": record["flops"] / best / record["gemm_peak_flops"],
                               "forward_peak_mb": v["forward_peak_mb"], "weight_mb": v["weight_mb"]}
    parts = [f"{n} {m['median_s'] * 1e3:.0f} ms (MFU {m['mfu']:.0%})" for n, m in variants.items()]
    figure = f"4 blocks at {FULL}, per forward: " + ", ".join(parts)
    return figure, {"variants": variants, "flops": record["flops"], "gemm_peak_flops": record["gemm_peak_flops"]}


def fl2va_plan(ctx: AcceptanceContext, budget_s: float) -> tuple[str, dict]:
    """The planner's verdict for the issue's target (no device needed)."""
    plan = ctx.plan_from_argv(["--preset", "released", "--task-type", "fl2va", "--task", "fl2va",
                                "--width", "1344", "--height", "768", "--device", "cuda", "--device-memory", "32GiB",
                                "--quantization", "fp8", "--diffusion-offload-config", json.dumps(FL2VA_OFFLOAD)])
    rank = max(plan.ranks, key=lambda r: r.peak_device_bytes)
    data = {"peak_device_bytes": plan.peak_device_bytes, "peak_tensor_bytes": plan.peak_tensor_bytes,
            "peak_stage": rank.peak_stage, "fits": plan.fits, "shortfall_bytes": plan.shortfall_bytes,
            "headroom_bytes": plan.headroom, "device_memory": plan.device_memory,
            "denoise_chunk_rows": plan.denoise_chunk_rows}
    ctx.shared["fl2va_plan"] = data
    verdict = "fits" if plan.fits else f"does not fit by {plan.shortfall_bytes / 2**30:.2f} GiB"
    if plan.denoise_chunk_rows:
        verdict += f" (denoise in {plan.denoise_chunk_rows}-row chunks)"
    return (f"released FL2VA 1344x768, 5 s, FP8, AdaLN/encoder/VAEs on the host, 1 x 32 GiB: peak "
            f"{plan.peak_device_bytes / 2**30:.2f} GiB ({rank.peak_stage}), {verdict} with "
            f"{plan.headroom / 2**30:.0f} GiB headroom"), data


def checkpoint(ctx: AcceptanceContext, budget_s: float) -> tuple[str, dict]:
    ctx.gpu()
    start = time.perf_counter()
    tail = h3serve(["make-tiny-checkpoint", "--default", "--preset", GPU_PRESET], budget_s, ctx.log)
    ctx.shared["checkpoint"] = tail.strip().splitlines()[-1]
    adapter = ctx.out / "turbo-adapter"
    if not adapter.exists():
        left = budget_s - (time.perf_counter() - start)
        h3serve(["make-tiny-adapter", str(adapter), "--format", "turbo", "--preset", GPU_PRESET], left, ctx.log)
    ctx.shared["turbo"] = str(adapter)
    return f"{GPU_PRESET}: {ctx.shared['checkpoint']}; synthetic Turbo adapter (rank 8)", {
        "checkpoint": ctx.shared["checkpoint"], "adapter": str(adapter)}


def _needs_checkpoint(ctx: AcceptanceContext) -> None:
    ctx.gpu()
    if "checkpoint" not in ctx.shared:
        raise Skip("the checkpoint row did not build the gpu-accept checkpoint")


def _peak(record: dict) -> dict:
    memory = record["memory"]
    peak, planned = memory["peak_device_allocated_mb"], memory["planned_peak_tensor_mb"]
    return {"peak_mb": peak, "planned_mb": planned, "error": peak / planned - 1 if planned else None,
            "denoise_per_step_s": record["stages"]["denoise_per_step"], "e2e_s": record["e2e_engine_s"]}


def full_depth(ctx: AcceptanceContext, budget_s: float) -> tuple[str, dict]:
    _needs_checkpoint(ctx)
    folder = ctx.out / "full_depth"
    h3serve(["bench", "--full-depth", "--model", ctx.shared["checkpoint"], "--shape", FULL, "--gemm-seconds", "0.5",
             "--out", str(folder)], budget_s, ctx.log)
    record = json.loads((folder / "full_depth.json").read_text())
    forwards = ", ".join(f"{s:.2f}" for s in record["forwards_s"])
    tiny = [part for part, size in record["sizes"].items() if size != "released"]
    encoders = "; ".join(f"{name} {e['seconds']:.2f} s" if "seconds" in e else f"{name}: {e['error']}"
                         for name, e in record["encoders"].items())
    figure = (f"Turbo-4 T2VA {FULL}, full depth ({'all released' if not tiny else 'tiny: ' + ', '.join(tiny)}): "
              f"whole request {record['e2e_s']:.2f} s, forwards {forwards} s (MFU {record['mfu']:.0%}), outside the "
              f"forwards {record['outside_forwards_s']:.2f} s (target <= 2 s); MP4 {encoders}")
    return figure, record


def offload_modes(ctx: AcceptanceContext, budget_s: float) -> tuple[str, dict]:
    _needs_checkpoint(ctx)
    records = _matrix(ctx, "offload_modes", budget_s)
    modes = {r["config"]["engine"]: _peak(r) for r in records}
    ctx.shared["offload_modes"] = modes
    parts = [f"{n} {m['peak_mb'] / 1024:.2f} / {m['planned_mb'] / 1024:.2f} GiB ({m['error']:+.0%})"
             for n, m in modes.items()]
    over = [n for n, m in modes.items() if m["error"] is not None and m["error"] > PEAK_MARGIN]
    figure = "allocator peak / plan (tensors): " + ", ".join(parts)
    if over:
        raise CheckFailed(f"{figure}: the planner under-promises for {', '.join(over)} (over +{PEAK_MARGIN:.0%})")
    return figure, {"modes": modes}


def adaln(ctx: AcceptanceContext, budget_s: float) -> tuple[str, dict]:
    ctx.gpu()
    modes = ctx.shared.get("offload_modes")
    if not modes or not {"resident", "adaln-host"} <= set(modes):
        raise Skip("the offload_modes row did not run its resident and adaln-host engines")
    device, host = modes["resident"], modes["adaln-host"]
    figure = (f"denoise/step {host['denoise_per_step_s']:.3f} s on the host vs {device['denoise_per_step_s']:.3f} s "
              f"on the device; peak {host['peak_mb'] / 1024:.2f} vs {device['peak_mb'] / 1024:.2f} GiB")
    return figure, {"host": host, "device": device}


def turbo(ctx: AcceptanceContext, budget_s: float) -> tuple[str, dict]:
    _needs_checkpoint(ctx)
    records = _matrix(ctx, "turbo", budget_s)
    runs = {r["config"]["engine"]: {"e2e_s": r["e2e_engine_s"], "denoise_s": r["stages"]["denoise"],
                                     "forwards": r["request"]["steps"]} for r in records}
    base, fast = runs["base-50"], runs["turbo-4"]
    figure = (f"832x480x124: whole request {fast['e2e_s']:.2f} / {base['e2e_s']:.2f} s "
              f"({fast['e2e_s'] / base['e2e_s']:.3f}x), denoise {fast['denoise_s'] / base['denoise_s']:.3f}x")
    return figure, {"runs": runs}


def fl2va_measured(ctx: AcceptanceContext, budget_s: float) -> tuple[str, dict]:
    _needs_checkpoint(ctx)
    if "fl2va_plan" not in ctx.shared:
        raise Skip("the plan.fl2va_32gib row did not run")
    records = _matrix(ctx, "fl2va_32gib", budget_s)
    m = _peak(records[0])
    released = ctx.shared["fl2va_plan"]
    # The error on the few-block DiT is the activations' and runtime's (the weights are counted exactly): carry
    # it over to the released plan's tensors as an absolute figure.
    corrected = released["peak_device_bytes"] + (m["peak_mb"] - m["planned_mb"]) * 2**20
    fits = corrected + released["headroom_bytes"] <= released["device_memory"]
    figure = (f"{GPU_PRESET} FL2VA {FULL}: allocator peak {m['peak_mb'] / 1024:.2f} GiB vs planned "
              f"{m['planned_mb'] / 1024:.2f} GiB ({m['error']:+.1%}); released peak corrected by it "
              f"{corrected / 2**30:.2f} GiB: {'fits' if fits else 'does not fit'} 1 x 32 GiB")
    data = {"measured": m, "released_corrected_bytes": corrected, "released_fits": fits}
    if m["error"] is not None and m["error"] > PEAK_MARGIN:
        raise CheckFailed(f"{figure}: the planner under-promises by more than {PEAK_MARGIN:.0%}")
    return figure, data


# Budgets from the first H200 run (2026-12-04, docs/benchmarks.md § GPU): selftest 88 s, dit_forward 24-31 s, the
# planner 11-15 s, the checkpoint 61 s (71-74 s on a cold machine: it draws 3.4 B weights on every core and stores
# the DiTs in bfloat16; its first budget of 75 s killed the one-core draw). The request rows were killed at their
# first budgets (80, 45, 35 s): one compiled 1344x768 T2VA request took 30 s end to end after a 6.8 s load; they now
# run eager. The second H200 run (the same day, a later session) killed the eager turbo row at 65 s (two engines,
# one of 50 steps). The full_depth row (issue 58) is estimated, never run: ~20 s of start and weights, a compile of
# ~17 s (the selftest's first compiled call), two Turbo-4 requests of ~6 s per forward (the 4-block figure x 13) with
# the released VAEs' decode, two MP4 encodes. Its 130 s came from the measured rows' margins (selftest 95, dit_forward
# 32, planner 15, checkpoint 80) and the never-run rows' (offload_modes 95, turbo 75, fl2va 37): they sum to 560 s.
ROWS = (
    Row("selftest", "`h3serve selftest` on this device", 95.0, selftest),
    Row("dit_forward", "bf16 / FP8 DiT step time and MFU at full width", 32.0, dit_forward),
    Row("plan.fl2va_32gib", "the 1 x 32 GiB FL2VA plan (planner)", 15.0, fl2va_plan),
    Row("checkpoint", "full-width few-block checkpoint for the request rows", 80.0, checkpoint),
    Row("full_depth", "the released DiT at full depth: Turbo-4 T2VA 1344x768x124, MFU, timeline", 130.0, full_depth),
    Row("offload_modes", "allocator peak vs plan per offload mode", 95.0, offload_modes),
    Row("adaln_host_vs_device", "AdaLN on the host vs on the device", 1.0, adaln),
    Row("turbo_4_vs_50", "Turbo-4 vs 50 forwards", 75.0, turbo),
    Row("fl2va_32gib.measured", "the 1 x 32 GiB FL2VA plan against an allocator measurement", 37.0, fl2va_measured),
)


# ------------------------------------------------------------------------------------------------------------
# Running and reporting
def run_row(row: Row, ctx: AcceptanceContext) -> RowResult:
    """One row: its figure, "skipped: why", or the failure; never started past the global budget."""
    result = RowResult(row.name, row.what, SKIP, row.budget_s)
    if ctx.left_s() < row.budget_s:
        result.message = f"the global budget ({ctx.budget_s:.0f} s) has {max(0.0, ctx.left_s()):.0f} s left"
        return result
    start = time.perf_counter()
    try:
        result.figure, result.data = row.run(ctx, row.budget_s)
        result.status = PASS
    except Skip as e:
        result.message = str(e)
    except CheckFailed as e:
        result.status, result.message = FAIL, str(e)
    except Exception as e:  # a crash fails its row, not the command: the JSON and table are still written
        result.status, result.message = FAIL, f"{type(e).__name__}: {e}"
    result.seconds = time.perf_counter() - start
    ctx.log(f"[gpu-acceptance] {row.name}: {result.status} in {result.seconds:.1f} s")
    return result


def run(ctx: AcceptanceContext, rows: tuple[Row, ...] = ROWS) -> dict:
    """Every row in order; the JSON record (`SCHEMA`)."""
    ctx.out.mkdir(parents=True, exist_ok=True)
    results = [run_row(row, ctx) for row in rows]
    failed = [r.name for r in results if r.status == FAIL]
    passed = sum(r.status == PASS for r in results)
    skipped = len(results) - passed - len(failed)
    verdict = (f"FAIL ({', '.join(failed)})" if failed else "OK") + f": {passed} passed, {skipped} skipped"
    return {"schema": SCHEMA, "device": ctx.device_name, "cuda": ctx.cuda, "budget_s": ctx.budget_s,
            "seconds": time.perf_counter() - ctx.started, "verdict": verdict,
            "rows": [asdict(r) for r in results]}


def table(record: dict) -> str:
    """The `docs/benchmarks.md` § GPU table: one line per row."""
    lines = [f"GPU acceptance on {record['device']} ({record['seconds']:.0f} s of {record['budget_s']:.0f} s): "
             f"{record['verdict']}", "", "| row | what | result | time / budget | figure |", "|---|---|---|---|---|"]
    for r in record["rows"]:
        text = r["figure"] if r["status"] == PASS else f"{r['status']}: {r['message']}"
        lines.append(f"| {r['name']} | {r['what']} | {r['status']} | {r['seconds']:.0f} / {r['budget_s']:.0f} s | "
                     f"{text.replace('|', '/')} |")
    return "\n".join(lines) + "\n"


def device() -> tuple[bool, str]:
    import torch

    if torch.cuda.is_available():
        return True, f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
    return False, f"CPU only ({os.cpu_count()} CPUs)"
