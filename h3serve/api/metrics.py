"""Prometheus metrics in the text exposition format: queue depth, jobs by state, per-replica state, latency
histograms."""

from __future__ import annotations

import math
import threading
from collections import defaultdict
from collections.abc import Iterable

from h3serve.engine.jobs import JobManager
from h3serve.jobstore.records import JOB_STATUSES, Job

# Seconds: a tiny CPU job's stage takes milliseconds; a 15 s 1344x768 video denoises for many minutes.
LATENCY_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1200, 1800, 3600)


def _number(value: float) -> str:
    return "+Inf" if math.isinf(value) else f"{value:g}"


class Histogram:
    """A labelled histogram (one label), thread-safe; `render` writes the _bucket/_sum/_count lines."""

    def __init__(self, name: str, help_text: str, label: str, buckets: Iterable[float] = LATENCY_BUCKETS):
        self.name, self.help, self.label = name, help_text, label
        self.buckets = (*sorted(buckets), math.inf)
        self._counts: dict[str, list[int]] = defaultdict(lambda: [0] * len(self.buckets))
        self._sums: dict[str, float] = defaultdict(float)
        self._lock = threading.Lock()

    def observe(self, label_value: str, value: float) -> None:
        with self._lock:
            counts = self._counts[label_value]
            for i, bound in enumerate(self.buckets):
                if value <= bound:
                    counts[i] += 1
            self._sums[label_value] += value

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        with self._lock:
            for value in sorted(self._counts):
                labels = f'{self.label}="{value}"'
                counts = self._counts[value]
                lines += [
                    f'{self.name}_bucket{{{labels},le="{_number(b)}"}} {c}'
                    for b, c in zip(self.buckets, counts, strict=True)
                ]
                lines.append(f"{self.name}_sum{{{labels}}} {self._sums[value]:g}")
                lines.append(f"{self.name}_count{{{labels}}} {counts[-1]}")
        return lines


class Metrics:
    """Fed by the job manager (`on_job_finished`), rendered on every scrape with the live gauges."""

    def __init__(self) -> None:
        self.stage_seconds = Histogram(
            "h3serve_stage_duration_seconds", "Duration of each generation stage of finished jobs.", "stage"
        )
        self.job_seconds = Histogram(
            "h3serve_job_duration_seconds", "Wall time of a job from start to finish (queue time excluded).", "status"
        )
        self.queue_wait_seconds = Histogram(
            "h3serve_queue_wait_seconds", "Time from submission until an engine replica took the job.", "replica"
        )

        self.request_timeouts = {"headers": 0, "body": 0}  # 408s of the HTTP server's slow-client guards

    def count_request_timeout(self, phase: str) -> None:
        """Called on the event loop (one thread): a plain increment."""
        self.request_timeouts[phase] += 1

    def on_job_started(self, replica: int, queue_wait_s: float) -> None:
        self.queue_wait_seconds.observe(str(replica), queue_wait_s)

    def on_job_finished(self, job: Job) -> None:
        for stage, seconds in job.stage_durations.items():
            self.stage_seconds.observe(stage, seconds)
        if job.inference_time_s is not None:
            self.job_seconds.observe(job.status, job.inference_time_s)

    def render(self, manager: JobManager, jobs_by_state: dict[str, int]) -> str:
        replicas = manager.replicas()
        lines = [
            "# HELP h3serve_queue_depth Jobs waiting for the engine (the running one excluded).",
            "# TYPE h3serve_queue_depth gauge",
            f"h3serve_queue_depth {manager.queue_depth}",
            "# HELP h3serve_jobs Stored jobs by state.",
            "# TYPE h3serve_jobs gauge",
            *(f'h3serve_jobs{{state="{s}"}} {jobs_by_state.get(s, 0)}' for s in JOB_STATUSES),
            "# HELP h3serve_engine_up Whether the engine's rank processes and the job runner are alive.",
            "# TYPE h3serve_engine_up gauge",
            f"h3serve_engine_up {int(manager.healthy())}",
            "# HELP h3serve_replica_up Whether an engine replica's rank processes and job runner are alive.",
            "# TYPE h3serve_replica_up gauge",
            *(f'h3serve_replica_up{{replica="{r.index}"}} {int(r.problem is None)}' for r in replicas),
            "# HELP h3serve_replica_busy Whether an engine replica is running a job.",
            "# TYPE h3serve_replica_busy gauge",
            *(f'h3serve_replica_busy{{replica="{r.index}"}} {int(r.busy)}' for r in replicas),
            "# HELP h3serve_replica_jobs_served_total Jobs an engine replica has run (any outcome).",
            "# TYPE h3serve_replica_jobs_served_total counter",
            *(f'h3serve_replica_jobs_served_total{{replica="{r.index}"}} {r.jobs_served}' for r in replicas),
            "# HELP h3serve_request_timeouts_total Connections answered 408 and closed: request headers or body "
            "stalled (--header-timeout, --body-timeout).",
            "# TYPE h3serve_request_timeouts_total counter",
            *(f'h3serve_request_timeouts_total{{phase="{p}"}} {n}' for p, n in self.request_timeouts.items()),
            *self.queue_wait_seconds.render(),
            *self.stage_seconds.render(),
            *self.job_seconds.render(),
        ]
        return "\n".join(lines) + "\n"
