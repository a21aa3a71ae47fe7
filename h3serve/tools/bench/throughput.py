"""`h3serve bench --replicas 1,2 [--overlap on,off] --jobs 8`: jobs per minute through the server's own path
(the store-driven queue, N data-parallel replicas on CPU with a fixed thread count each, MP4 encoding with the
server's default encoder settings, with or without the output overlap), one line per layout and the speed-up
over the first. Engine start-up and one warm-up job per replica are not timed; the layouts are timed in
alternation over several rounds and the median round is reported. Every layout must write the same MP4 bytes
for the same seed (checked)."""

from __future__ import annotations

import contextlib
import hashlib
import math
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from h3serve.config.engine_config import EngineConfig
from h3serve.config_checks import check_config
from h3serve.engine.jobs import JobManager
from h3serve.engine.replicas import start_replicas
from h3serve.jobstore.job_files import JobFiles
from h3serve.jobstore.records import FINISHED
from h3serve.jobstore.sqlite import SQLiteJobStore
from h3serve.media.mp4 import EncoderOptions
from h3serve.media.previews import VARIANTS
from h3serve.parallel.rendezvous import Rendezvous
from h3serve.rules.request import GenerationRequest

PROMPT = "A red fox trots through fresh snow at dawn."


@dataclass(frozen=True)
class ReplicaLayout:
    replicas: int
    overlap: bool  # the mux of a finished job overlaps the next job's run (the server's default)

    def __str__(self) -> str:
        return f"{self.replicas} replica(s), overlap {'on' if self.overlap else 'off'}"


@dataclass(frozen=True)
class Throughput:
    layout: ReplicaLayout
    threads: int  # per rank
    jobs: int
    seconds: float  # the median round

    @property
    def jobs_per_minute(self) -> float:
        return 60.0 * self.jobs / self.seconds


def _run_batch(manager: JobManager, count: int, steps: int, seed0: int, timeout_s: float) -> dict[int, str]:
    """Run `count` jobs (seeds seed0, seed0 + 1, ...) to completion; the SHA-256 of each one's MP4, by seed."""
    ids = []
    for seed in range(seed0, seed0 + count):
        request = GenerationRequest(prompt=PROMPT, width=128, height=64, duration_s=4, steps=steps, seed=seed)
        ids.append(manager.submit(request, seconds="4").id)
    deadline = time.monotonic() + timeout_s
    while True:
        jobs = [manager.store.get(i) for i in ids]
        if all(j is not None and j.status in FINISHED for j in jobs):
            failed = [j.error for j in jobs if j.status != "completed"]
            if failed:
                raise RuntimeError(f"{len(failed)} bench job(s) failed: {failed[0]}")
            return {
                seed0 + k: hashlib.sha256(manager.files.file(i, VARIANTS["video"].file_name).read_bytes()).hexdigest()
                for k, i in enumerate(ids)
            }
        if time.monotonic() > deadline:
            raise TimeoutError(f"the bench jobs did not finish within {timeout_s:g} s")
        time.sleep(0.05)


@contextlib.contextmanager
def _server(
    model: Path, layout: ReplicaLayout, jobs: int, threads: int, log: Callable[[str], None]
) -> Iterator[JobManager]:
    """A job manager over `layout.replicas` CPU replicas of `threads` threads per rank, on a temporary store."""
    replicas = layout.replicas
    config = check_config(EngineConfig(model=model, device="cpu", threads=threads, data_parallel_size=replicas))
    log(f"starting {layout} x {threads} thread(s)")
    executors = start_replicas(config, Rendezvous.local())
    try:
        with tempfile.TemporaryDirectory(prefix="h3serve-bench-") as tmp:
            store = SQLiteJobStore(Path(tmp) / "jobs.sqlite3")
            # No cost limit: the bench measures throughput, whatever it is asked to run.
            manager = JobManager(executors, store, JobFiles(Path(tmp) / "jobs"), model_name="bench",
                                 max_request_cost=math.inf, max_queue=jobs + replicas,
                                 encoder_options=EncoderOptions(), poll_s=0.02, overlap_output=layout.overlap)
            manager.start()
            try:
                yield manager
            finally:
                manager.close()
                store.close()
    finally:
        for executor in executors:
            executor.close()


def measure(model: Path, layouts: list[ReplicaLayout], jobs: int, steps: int, threads: int, rounds: int,
            log: Callable[[str], None], timeout_s: float = 3600.0) -> list[Throughput]:
    """Every layout's jobs/minute: all servers start first (idle ranks cost no CPU), each is warmed up with one
    job per replica, then `rounds` rounds time `jobs` jobs on each in turn (A/B alternation, so a change in the
    machine's load hits every layout alike); the median round counts. Raises if two layouts wrote different MP4
    bytes for one seed."""
    with contextlib.ExitStack() as stack:
        managers = [stack.enter_context(_server(model, layout, jobs, threads, log)) for layout in layouts]
        for layout, manager in zip(layouts, managers, strict=True):
            _run_batch(manager, layout.replicas, steps, 10_000, timeout_s)
        times: list[list[float]] = [[] for _ in layouts]
        outputs: list[dict[int, str]] = [{} for _ in layouts]
        for round_ in range(rounds):
            for i, manager in enumerate(managers):
                start = time.monotonic()
                outputs[i] |= _run_batch(manager, jobs, steps, round_ * jobs, timeout_s)
                times[i].append(time.monotonic() - start)
                log(f"round {round_ + 1}: {layouts[i]}: {jobs} jobs in {times[i][-1]:.1f} s")
    differing = [str(layout) for layout, out in zip(layouts, outputs, strict=True) if out != outputs[0]]
    if differing:
        raise RuntimeError(f"outputs differ from {layouts[0]}'s for the same seeds: {', '.join(differing)}")
    return [Throughput(layout, threads, jobs, statistics.median(t)) for layout, t in zip(layouts, times, strict=True)]


def summary(results: list[Throughput], steps: int) -> str:
    """A Markdown table: one row per replica count, the speed-up over the first row."""
    base = results[0].jobs_per_minute
    lines = [
        f"| replicas x threads | output overlap | jobs | seconds (median round) | jobs/min | speed-up |  (128x64, "
        f"4 s, {steps} steps (forwards), CPU; same MP4 bytes per seed in every layout)",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        overlap = "on" if r.layout.overlap else "off"
        lines.append(f"| {r.layout.replicas} x {r.threads} | {overlap} | {r.jobs} | {r.seconds:.1f} | "
                     f"{r.jobs_per_minute:.1f} | {r.jobs_per_minute / base:.2f}x |")
    return "\n".join(lines)
