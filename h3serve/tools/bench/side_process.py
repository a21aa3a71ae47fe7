"""One bench side (h3serve or the diffusers peer) in its own process: its memory, threads and profile are its own.

The parent sends ("run", RunSpec) / ("gemm", seconds) / ("stop", None) over a pipe. For a run the worker answers
("written", None) the moment the MP4 is complete (the parent's client clock stops there: what a client of a server
waits for), then ("result", record) once its bookkeeping is done (hashes, CPU time, the planner's prediction), then
writes the raw arrays and answers ("raw", path). Any failure answers ("error", traceback).
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import time
import traceback
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING, Any

from h3serve.config.engine_config import EngineConfig
from h3serve.errors import ServerError
from h3serve.rules.request import GenerationRequest

if TYPE_CHECKING:  # the parent never imports torch through this module
    from h3serve.tools.bench.flops import FlopCounter
    from h3serve.tools.bench.runners import DiffusersRunner, H3Runner, RunOutput

    Runner = H3Runner | DiffusersRunner


class BenchError(ServerError, RuntimeError):
    """A bench side failed to start or to run; the message carries its traceback."""

    code = "bench_failed"


@dataclass(frozen=True)
class RunSpec:
    case_id: str
    request: GenerationRequest
    phase: str  # warmup | measured | profile
    index: int
    mp4_path: str
    raw_path: str | None = None  # where to write the float arrays (for fidelity); None: not kept
    stream: bool = False  # h3serve side: decode straight into the MP4 (no float arrays, no raw hash)
    trace_path: str | None = None  # profile this run into a Chrome trace here
    warm_prompt_cache: bool = False  # h3serve side: keep the prompt cache from earlier runs (default: start it empty)


def _run(
    runner: Runner, counter: FlopCounter, spec: RunSpec, written: Callable[[], None]
) -> tuple[dict[str, Any], RunOutput]:
    """One request: the engine's clock around it, `written()` as soon as the MP4 is complete, then the record."""
    import numpy as np
    import torch

    from h3serve.media.mp4 import write_mp4
    from h3serve.rank.memory import RssSampler
    from h3serve.tools.bench.measure import cpu_seconds
    from h3serve.tools.bench.profiling import profiled
    from h3serve.tools.bench.runners import H3Runner
    from h3serve.tools.bench.stage_rss import sampling_stages, stage_record

    device = runner.device
    counter.reset()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    profile: dict[str, Any] = {}
    tracing = profiled(Path(spec.trace_path), device, profile) if spec.trace_path else nullcontext()
    load_before, cpu_before = os.getloadavg()[0], cpu_seconds()
    local = runner.local if isinstance(runner, H3Runner) else None  # in-process h3serve: its stages are sampled
    if isinstance(runner, H3Runner) and not spec.warm_prompt_cache:
        runner.clear_prompt_cache()  # a cold cache: the text encode is measured, whatever ran before
    with RssSampler() as rss, tracing, sampling_stages(local.pipeline if local else None, rss):
        Path(spec.mp4_path).parent.mkdir(parents=True, exist_ok=True)
        origin = time.monotonic()
        out = runner.run(spec.request, spec.mp4_path if spec.stream else None)
        engine_s = time.monotonic() - origin
        spans = list(out.stage_timeline or [])
        if out.video is not None:  # streamed: the MP4 was written during the decode (its own `mux` span)
            start = time.monotonic()
            with rss.stage("mux"):
                write_mp4(spec.mp4_path, out.video, out.audio)
            out.stage_durations["mux"] = time.monotonic() - start
            spans.append(("mux", start, time.monotonic()))
        written()
    cpu_s = cpu_seconds() - cpu_before
    raw = None
    if out.video is not None:
        raw = hashlib.sha256(np.ascontiguousarray(out.video).tobytes())
        raw.update(np.ascontiguousarray(out.audio).tobytes())
    plan = out.plan
    if isinstance(runner, H3Runner):
        out.placement = runner.placement(plan)
    record = {
        "request": {
            "task": plan.task, "width": plan.width, "height": plan.height, "num_frames": plan.num_frames,
            "steps": plan.steps, "seed": plan.seed, "prompt": plan.prompt,
        },
        "e2e_engine_s": engine_s,
        "cpu_s": cpu_s,  # CPU seconds this side's processes spent on the run (engine + mux)
        "host_load_1min": [load_before, os.getloadavg()[0]],  # before / after: high values flag a contended run
        "stages": out.stage_durations,
        # Every stage's runs as [stage, start, end] in seconds from the request's start (stages beside each other
        # overlap: the streamed MP4 encode and the video decode).
        "timeline": [[name, round(start - origin, 6), round(end - origin, 6)]
                     for name, start, end in sorted(spans, key=lambda span: span[1])],
        "dit": {
            "forwards": counter.forwards,
            "flops": counter.flops,
            "forward_s": counter.forward_s,
            "forward_shapes": [asdict(s) | {"seq_len": s.seq_len} for s in sorted(counter.shapes, key=str)],
        } if runner.dits() else None,
        "memory": {
            "peak_device_allocated_mb": torch.cuda.max_memory_allocated(device) / 2**20
            if device.type == "cuda" else None,
            "peak_rss_sampled_mb": rss.peak_bytes / 2**20,
            "rss_before_run_mb": rss.start_bytes / 2**20,  # the loaded engine: the peak less this is the request's
            "peak_rss_process_mb": _process_lifetime_rss_mb(),
            # Per stage (in-process h3serve engine only): RSS at its start, its peak, what it added; and the
            # decode-and-write span (audio + video decode, and the full decode's mux): the decode's working set.
            "stage_rss": stage_record(rss),
            # The memory planner's prediction for this request (h3serve side): peak per rank and the stage.
            "planned_peak_device_mb": out.placement["peak_device_bytes"] / 2**20 if out.placement else None,
            # Its tensor part alone: what `peak_device_allocated_mb` (the allocator's peak) is to be compared with.
            "planned_peak_tensor_mb": out.placement["peak_tensor_bytes"] / 2**20 if out.placement else None,
            "placement": out.placement,
        },
        # Weights the offload hooks copied onto the device, per stage and component (layerwise: per step = the
        # denoise stage's DiT bytes over the forwards).
        "streamed_bytes": out.streamed,
        "output": {
            "mp4": spec.mp4_path,
            "mp4_sha256": hashlib.sha256(Path(spec.mp4_path).read_bytes()).hexdigest(),
            "raw_sha256": None if raw is None else raw.hexdigest(),
            "frames": out.num_frames,
            "samples": int(out.audio.shape[-1]),
        },
        "profile": profile or None,
    }
    return record, out


def worker_main(side: str, config: EngineConfig, tasks: tuple[str, ...], conn: Connection) -> None:
    """Process entry: build the side's runner, report readiness, then serve commands until "stop"."""
    try:
        import torch

        from h3serve.media.raw import write_raw
        from h3serve.tools.bench.flops import FlopCounter
        from h3serve.tools.bench.measure import environment, gemm_peak
        from h3serve.tools.bench.runners import RUNNERS

        if config.threads:
            torch.set_num_threads(config.threads)
        start = time.perf_counter()
        runner = RUNNERS[side](config, tasks)
        counter = FlopCounter()
        for dit, cfg, shape_of in runner.dits():
            counter.attach(dit, cfg, shape_of)
        conn.send(("ready", {"load_s": time.perf_counter() - start, "environment": environment(runner.device)}))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    try:
        while True:
            command, payload = conn.recv()
            if command == "stop":
                return
            try:
                if command == "gemm":
                    conn.send(("gemm", gemm_peak(runner.device, runner.dtype, payload)))
                elif command == "run":
                    record, out = _run(runner, counter, payload, lambda: conn.send(("written", None)))
                    conn.send(("result", record))
                    if payload.raw_path:
                        Path(payload.raw_path).parent.mkdir(parents=True, exist_ok=True)
                        write_raw(payload.raw_path, out.video, out.audio)
                        conn.send(("raw", payload.raw_path))
                else:
                    conn.send(("error", f"unknown command {command!r}"))
            except Exception:
                conn.send(("error", traceback.format_exc()))
    finally:
        runner.close()


class Worker:
    """The parent's handle on one side's process. Call `wait_ready` before anything else."""

    def __init__(self, side: str, config: EngineConfig, tasks: tuple[str, ...]):
        self.side = side
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        # Not a daemon: a multi-rank engine starts its rank processes from inside this one.
        self._proc = ctx.Process(target=worker_main, args=(side, config, tasks, child), name=f"h3serve-bench-{side}")
        self._proc.start()
        child.close()
        self.info: dict[str, Any] = {}

    def wait_ready(self, timeout_s: float = 1800.0) -> dict[str, Any]:
        """Block until the side has loaded; returns {load_s, environment}."""
        self.info = self._expect("ready", timeout_s)
        return self.info

    def _expect(self, kind: str, timeout_s: float | None = None) -> Any:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not self._conn.poll(0.5):
            if not self._proc.is_alive():
                raise BenchError(f"{self.side} worker exited with code {self._proc.exitcode}")
            if deadline is not None and time.monotonic() > deadline:
                raise BenchError(f"{self.side} worker did not answer within {timeout_s:g} s")
        got, payload = self._conn.recv()
        if got == "error":
            raise BenchError(f"{self.side} worker failed:\n{payload}")
        if got != kind:
            raise BenchError(f"{self.side} worker answered {got!r}, expected {kind!r}")
        return payload

    def gemm_peak(self, budget_s: float) -> dict[str, float]:
        self._conn.send(("gemm", budget_s))
        return self._expect("gemm")

    def run(self, spec: RunSpec) -> dict[str, Any]:
        """One request; adds the client-side E2E (send -> MP4 written) to the worker's record."""
        start = time.perf_counter()
        self._conn.send(("run", spec))
        self._expect("written")
        client_s = time.perf_counter() - start
        record = self._expect("result")
        record["e2e_client_s"] = client_s
        if spec.raw_path:
            self._expect("raw")
        return record

    def close(self) -> None:
        if self._proc.is_alive():
            try:
                self._conn.send(("stop", None))
            except OSError:
                pass
            self._proc.join(timeout=30)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(timeout=10)
        self._conn.close()


def _process_lifetime_rss_mb() -> float:
    """ru_maxrss: the process' lifetime high-water mark (KiB on Linux, bytes on macOS)."""
    import resource
    import sys

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**20 if sys.platform == "darwin" else rss / 1024
