"""`h3serve bench --replicas 1,2 --jobs 8`: jobs per minute through the server's own path (the store-driven
queue, N data-parallel replicas on CPU with a fixed thread count each, MP4 encoding), one line per replica
count and the speed-up over the first. Engine start-up and one warm-up job per replica are not timed; the
counts are timed in alternation over several rounds and the median round is reported."""

from __future__ import annotations

import contextlib
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from h3serve.config import EngineConfig
from h3serve.engine.jobs import JobManager
from h3serve.engine.replicas import start_replicas
from h3serve.jobstore.files import JobFiles
from h3serve.jobstore.records import FINISHED, Job, new_job_id
from h3serve.jobstore.sqlite import SQLiteJobStore
from h3serve.media.mp4 import EncoderOptions
from h3serve.parallel.rendezvous import Rendezvous
from h3serve.request import GenerationRequest
from h3serve.validate import validate

PROMPT = "A red fox trots through fresh snow at dawn."


@dataclass(frozen=True)
class Throughput:
    replicas: int
    threads: int  # per rank
    jobs: int
    seconds: float  # the median round

    @property
    def jobs_per_minute(self) -> float:
        return 60.0 * self.jobs / self.seconds


def _run_batch(manager: JobManager, count: int, steps: int, seed0: int, timeout_s: float) -> None:
    ids = []
    for seed in range(seed0, seed0 + count):
        request = GenerationRequest(prompt=PROMPT, width=128, height=64, duration_s=4, steps=steps, seed=seed)
        plan = validate(request, manager.defaults)
        ids.append(manager.submit(Job.planned(new_job_id(), "bench", request, plan, "4", int(time.time())), plan).id)
    deadline = time.monotonic() + timeout_s
    while True:
        jobs = [manager.store.get(i) for i in ids]
        if all(j is not None and j.status in FINISHED for j in jobs):
            failed = [j.error for j in jobs if j.status != "completed"]
            if failed:
                raise RuntimeError(f"{len(failed)} bench job(s) failed: {failed[0]}")
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"the bench jobs did not finish within {timeout_s:g} s")
        time.sleep(0.05)


@contextlib.contextmanager
def _server(model: Path, replicas: int, jobs: int, threads: int, log: Callable[[str], None]) -> Iterator[JobManager]:
    """A job manager over `replicas` CPU replicas of `threads` threads per rank, on a temporary store."""
    config = EngineConfig(model=model, device="cpu", threads=threads, data_parallel_size=replicas).validate()
    log(f"starting {replicas} replica(s) x {threads} thread(s)")
    executors = start_replicas(config, Rendezvous.local())
    try:
        with tempfile.TemporaryDirectory(prefix="h3serve-bench-") as tmp:
            store = SQLiteJobStore(Path(tmp) / "jobs.sqlite3")
            manager = JobManager(executors, store, JobFiles(Path(tmp) / "jobs"), max_queue=jobs + replicas,
                                 encoder_options=EncoderOptions(preset="ultrafast"), poll_s=0.02)
            manager.start()
            try:
                yield manager
            finally:
                manager.close()
                store.close()
    finally:
        for executor in executors:
            executor.close()


def measure(model: Path, counts: list[int], jobs: int, steps: int, threads: int, rounds: int,
            log: Callable[[str], None], timeout_s: float = 3600.0) -> list[Throughput]:
    """Every replica count's jobs/minute: all servers start first (idle ranks cost no CPU), each is warmed up
    with one job per replica, then `rounds` rounds time `jobs` jobs on each in turn (A/B alternation, so a
    change in the machine's load hits every count alike); the median round counts."""
    with contextlib.ExitStack() as stack:
        managers = [stack.enter_context(_server(model, n, jobs, threads, log)) for n in counts]
        for n, manager in zip(counts, managers, strict=True):
            _run_batch(manager, n, steps, 10_000, timeout_s)
        times: list[list[float]] = [[] for _ in counts]
        for round_ in range(rounds):
            for i, manager in enumerate(managers):
                start = time.monotonic()
                _run_batch(manager, jobs, steps, round_ * jobs, timeout_s)
                times[i].append(time.monotonic() - start)
                log(f"round {round_ + 1}: {counts[i]} replica(s): {jobs} jobs in {times[i][-1]:.1f} s")
    return [Throughput(n, threads, jobs, statistics.median(t)) for n, t in zip(counts, times, strict=True)]


def summary(results: list[Throughput], steps: int) -> str:
    """A Markdown table: one row per replica count, the speed-up over the first row."""
    base = results[0].jobs_per_minute
    lines = [
        f"| replicas x threads | jobs | seconds (median round) | jobs/min | speed-up |  (128x64, 4 s, {steps} "
        "steps, CPU)",
        "|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(f"| {r.replicas} x {r.threads} | {r.jobs} | {r.seconds:.1f} | {r.jobs_per_minute:.1f} | "
                     f"{r.jobs_per_minute / base:.2f}x |")
    return "\n".join(lines)
