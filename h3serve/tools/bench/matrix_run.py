"""The matrix runner: one process per side and engine config, A/B alternated runs, records, fidelity, summary.

Per case (task x shape x engine): a GEMM peak, warm-up runs, measured runs (h3serve and the peer alternate,
ABBA, so slow drift on a shared machine hits both alike), an optional profiled run per side, a second GEMM
peak. Every run appends one JSON record to `runs.jsonl`.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from h3serve.config.engine_config import EngineConfig
from h3serve.config_checks import check_config
from h3serve.rules import limits
from h3serve.rules.request import GenerationRequest, MediaRef
from h3serve.tools.bench.matrix import SIDE, BenchCase, BenchMatrix, EngineSpec, Shape
from h3serve.tools.bench.side_process import RunSpec, Worker

SCHEMA = "h3serve.bench.run/1"


@dataclass
class BenchResult:
    out_dir: Path
    records: list[dict[str, Any]]
    summary: dict[str, Any]
    summary_path: Path
    plots: list[Path]


def resolve_model(matrix: BenchMatrix) -> Path:
    if matrix.model:
        return Path(matrix.model).expanduser()
    from h3serve.tools.tiny.make_checkpoint import ensure_tiny_checkpoint

    return ensure_tiny_checkpoint(preset=matrix.preset)


def _synthetic_image(path: Path, width: int, height: int, phase: float) -> MediaRef:
    """A smooth colour gradient PNG of the given aspect: deterministic conditioning input for fl2va / ref2va.

    Scaled up, if needed, to the smallest size media intake accepts.
    """
    from PIL import Image

    scale = max(1.0, limits.MEDIA_IMAGE_MIN_EDGE / min(width, height))
    width, height = round(width * scale), round(height * scale)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    rgb = np.stack([x / width, y / height, 0.5 + 0.5 * np.sin(phase + (x + y) / 40.0)], axis=-1)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray((rgb * 255).astype(np.uint8)).save(path)
    return MediaRef(path=path, name=path.name, kind="image")


def build_request(matrix: BenchMatrix, case: BenchCase, inputs_dir: Path) -> GenerationRequest:
    s = case.shape
    request = GenerationRequest(
        prompt=matrix.prompt, width=s.width, height=s.height, num_frames=s.num_frames, steps=matrix.steps,
        seed=matrix.seed, task=case.task,
    )
    if s.num_frames > limits.MAX_DURATION_S * limits.FPS:  # past 15 s: one long-video pass (up to 30 s)
        request = replace(request, long_video=True, long_video_mode="full")
    if case.task == "fl2va":
        first = _synthetic_image(inputs_dir / f"first-{s.label}.png", s.width, s.height, 0.0)
        last = _synthetic_image(inputs_dir / f"last-{s.label}.png", s.width, s.height, 2.0)
        request = replace(request, image=first, last_image=last)
    elif case.task == "ref2va":
        request = replace(request, references=(_synthetic_image(inputs_dir / "reference.png", 1, 1, 1.0),))
    return request


def streams(engine: EngineSpec) -> bool:
    """Whether the h3serve side decodes straight into the MP4: only when the engine names `decode_mode: stream`.
    Otherwise it decodes in full, so that its measured runs keep the raw arrays the fidelity figures need."""
    return engine.options.get("decode_mode") == "stream"


def _fidelity(reference: Any, raw_path: str, label: str) -> dict[str, Any]:
    from h3serve.tools.clip_compare import compare_clips, load_clip

    return {"reference": label, **compare_clips(reference, load_clip(raw_path)).to_json()}


def _finish_dit(record: dict[str, Any], gemm: float) -> None:
    dit = record["dit"]
    if dit is None:
        return
    denoise = record["stages"].get("denoise")
    dit["flops_per_s"] = dit["flops"] / denoise if denoise else None
    dit["gemm_peak_flops_per_s"] = gemm
    dit["fraction_of_gemm_peak"] = dit["flops_per_s"] / gemm if dit["flops_per_s"] else None


class _Bench:
    def __init__(self, matrix: BenchMatrix, out_dir: Path, keep_raw: bool, log: Callable[[str], None]):
        self.m, self.out, self.keep_raw, self.log = matrix, out_dir, keep_raw, log
        self.model = resolve_model(matrix)
        self.records: list[dict[str, Any]] = []
        self.first_raw: dict[tuple[str, Shape], tuple[str, str]] = {}  # (task, shape) -> (raw path, label)
        self.file_reference = None
        if matrix.reference not in ("peer", "first"):
            from h3serve.tools.clip_compare import load_clip

            self.file_reference = load_clip(matrix.reference)

    def check_up_front(self) -> None:
        """Every engine config and request is checked before any process starts."""
        from h3serve.checkpoint.resolver import read_layout
        from h3serve.engine.planning import plan_request

        defaults = read_layout(self.model).defaults()
        if not self.m.shapes:
            plan = plan_request(GenerationRequest(prompt=self.m.prompt), defaults)
            self.m = replace(self.m, shapes=(Shape(plan.width, plan.height, plan.num_frames),))
        for engine in self.m.engines:
            check_config(self.engine_config(engine))
        for case in self.m.cases():
            plan_request(self.request_for(case), defaults)

    def request_for(self, case: BenchCase) -> GenerationRequest:
        """The case's request; an engine with `lora` names that preloaded adapter (its schedule, if pinned)."""
        request = build_request(self.m, case, self.out / "inputs")
        if case.engine.lora is None:
            return request
        from h3serve.adapters.catalog import LoraField
        from h3serve.adapters.serving import catalog_for

        choice = catalog_for(self.engine_config(case.engine)).choose(LoraField(name=case.engine.lora))
        steps = None if choice.turbo is not None else request.steps  # a Turbo adapter pins its forwards
        return replace(request, lora=choice, steps=steps)

    def engine_config(self, engine: EngineSpec) -> EngineConfig:
        """The engine's config; unless it sets `task_type`, only the DiTs the matrix's tasks need are loaded. With
        the prompt cache cold, a multi-rank engine runs without one (its ranks' caches cannot be emptied between
        runs; an in-process engine's is, before each run)."""
        config = engine.config(self.model)
        if self.m.prompt_cache == "cold" and config.world_size > 1:
            config = replace(config, prompt_cache_bytes=None)
        if "task_type" in engine.options:
            return config
        ref, main = "ref2va" in self.m.tasks, any(t != "ref2va" for t in self.m.tasks)
        return replace(config, task_type="auto" if ref and main else "ref2va" if ref else "fl2va")

    def run(self, command: str) -> None:
        runs_path = self.out / "runs.jsonl"
        for engine in self.m.engines:
            config = self.engine_config(engine)
            sides = [SIDE] + ([self.m.peer] if self.m.peer else [])
            workers: dict[str, Worker] = {}
            try:
                for side in sides:  # the sides load concurrently; runs never overlap
                    self.log(f"[{engine.name}] starting {side} ...")
                    workers[side] = Worker(side, config, self.m.tasks)
                for side, worker in workers.items():
                    self.log(f"[{engine.name}] {side} loaded in {worker.wait_ready()['load_s']:.1f} s")
                for case in (c for c in self.m.cases() if c.engine == engine):
                    records = self.run_case(case, workers, command)
                    with runs_path.open("a", encoding="utf-8") as f:
                        f.writelines(json.dumps(r) + "\n" for r in records)
                    self.records += records
            finally:
                for w in workers.values():
                    w.close()
        if not self.keep_raw:
            shutil.rmtree(self.out / "raw", ignore_errors=True)

    def run_case(self, case: BenchCase, workers: dict[str, Worker], command: str) -> list[dict[str, Any]]:
        request = self.request_for(case)
        sides = list(workers)
        gemm = [workers[SIDE].gemm_peak(self.m.gemm_seconds)]
        records: list[dict[str, Any]] = []
        phases = [("warmup", self.m.warmup), ("measured", self.m.runs)] + [("profile", 1)] * self.m.profile
        for phase, count in phases:
            for i in range(count):
                for side in sides if i % 2 == 0 else sides[::-1]:
                    stem = f"{case.id}/{side}-{phase}{i}"
                    stream = side == SIDE and streams(case.engine)
                    spec = RunSpec(
                        case_id=case.id, request=request, phase=phase, index=i,
                        mp4_path=str(self.out / "outputs" / f"{stem}.mp4"),
                        raw_path=str(self.out / "raw" / f"{stem}.npz") if phase == "measured" and not stream else None,
                        stream=stream,
                        trace_path=str(self.out / "profiles" / f"{stem}.json") if phase == "profile" else None,
                        warm_prompt_cache=self.m.prompt_cache == "warm",
                    )
                    record = workers[side].run(spec)
                    self.log(
                        f"[{case.id}] {side:9s} {phase} {i}: E2E {record['e2e_client_s']:.2f} s, "
                        f"denoise/step {record['stages']['denoise_per_step']:.3f} s"
                    )
                    records.append(self._frame(record, case, side, phase, i, workers[side], command, spec))
        gemm.append(workers[SIDE].gemm_peak(self.m.gemm_seconds))
        best = max(g["flops_per_s"] for g in gemm)
        for r in records:
            r["gemm_peak"] = {"flops_per_s": best, "samples": gemm}
            _finish_dit(r, best)
        self._add_fidelity(case, records)
        return records

    def _frame(
        self, record: dict, case: BenchCase, side: str, phase: str, i: int, worker: Worker, command: str, spec: RunSpec
    ) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "timestamp": datetime.now(UTC).isoformat(timespec="seconds"),
            "command": command,
            "case": case.id,
            "side": side,
            "phase": phase,
            "index": i,
            "environment": worker.info["environment"],
            "load_s": worker.info["load_s"],  # the side's start-up (imports excluded), once per engine config
            "config": {"engine": case.engine.name, **self._config_fields(case.engine),
                       "preset": None if self.m.model else self.m.preset},
            **record,
            "raw_path": spec.raw_path,
            "fidelity": None,
        }

    def _config_fields(self, engine: EngineSpec) -> dict[str, Any]:
        """Every EngineConfig field the side ran with (defaults included), JSON-ready."""
        return _jsonable(asdict(self.engine_config(engine)))

    def _add_fidelity(self, case: BenchCase, records: list[dict[str, Any]]) -> None:
        from h3serve.tools.clip_compare import load_clip

        measured = [r for r in records if r["phase"] == "measured"]
        if self.m.reference == "peer":
            peer = {r["index"]: r for r in measured if r["side"] == self.m.peer}
            for r in (r for r in measured if r["side"] == SIDE and r["raw_path"]):
                ref = peer[r["index"]]
                r["fidelity"] = _fidelity(load_clip(ref["raw_path"]), r["raw_path"], f"{self.m.peer} run {r['index']}")
        else:
            if self.file_reference is not None:
                reference, label = self.file_reference, str(self.m.reference)
            else:
                key = (case.task, case.shape)
                first = next((r for r in measured if r["side"] == SIDE and r["raw_path"]), None)
                if key not in self.first_raw and first is None:
                    return  # a streamed engine's runs keep no arrays; a later full-decode case sets the reference
                if key not in self.first_raw:
                    self.first_raw[key] = (first["raw_path"], f"{first['case']} {SIDE} run 0")
                path, label = self.first_raw[key]
                reference = load_clip(path)
            for r in (r for r in measured if r["raw_path"]):
                r["fidelity"] = _fidelity(reference, r["raw_path"], label)
        if not self.keep_raw:
            keep = {p for p, _ in self.first_raw.values()}
            for r in measured:
                if r["raw_path"] and r["raw_path"] not in keep:
                    Path(r["raw_path"]).unlink(missing_ok=True)
                    r["raw_path"] = None


def run_bench(
    matrix: BenchMatrix, out_dir: str | Path, command: str = "", keep_raw: bool = False,
    log: Callable[[str], None] = print,
) -> BenchResult:
    """Run the whole matrix into `out_dir`; returns the records, the summary and the plot paths."""
    from h3serve.tools.bench.report import make_plots, render_markdown, summarize

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    bench = _Bench(matrix, out, keep_raw, log)
    bench.check_up_front()
    started = time.perf_counter()
    bench.run(command)
    summary = summarize(bench.records, bench.m)
    summary["wall_s"] = time.perf_counter() - started
    plots = make_plots(bench.records, summary, out)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    summary_path = out / "summary.md"
    summary_path.write_text(render_markdown(summary, plots, command), encoding="utf-8")
    return BenchResult(out, bench.records, summary, summary_path, plots)


def _jsonable(value: Any) -> Any:
    """Paths as strings and sets (the offload components) as sorted lists, recursively."""
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, set | frozenset):
        return sorted(value)
    return value
