"""Prometheus metrics (prometheus_client): queue depth, jobs by state, per-replica state, slow-client timeouts,
latency histograms, the real-time sessions (open, chunks sent, time to first chunk, chunk interval, real-time
factor) and the webhook deliveries (by state in the outbox, attempts by outcome, attempt and delivery times). One
registry per app, so several servers in one process (the tests) never share counts."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from h3serve.engine.jobs import JobManager
from h3serve.engine.jobs.types import ReplicaStatus
from h3serve.engine.outbox.sender import ATTEMPT_OUTCOMES
from h3serve.jobstore.records import JOB_STATUSES, Job
from h3serve.jobstore.webhook_records import DELIVERY_STATES

# Seconds: a tiny CPU job's stage takes milliseconds; a 15 s 1344x768 video denoises for many minutes.
LATENCY_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1200, 1800, 3600)
TIMEOUT_PHASES = ("headers", "body")
# A chunk's interval over its media duration: below 1 the stream keeps ahead of playback.
UPLOAD_OUTCOMES = ("retried", "failed")  # a failed attempt at a job's outputs: tried again, or the job failed
REALTIME_FACTOR_BUCKETS = (0.05, 0.1, 0.25, 0.5, 0.75, 1, 1.25, 1.5, 2, 3, 5, 10, 30, 100)
CHUNK_KINDS = ("media", "trailer")

# No `*_created` series beside each histogram and counter: the exposition keeps the names it always had.
prometheus_client.disable_created_metrics()  # type: ignore[no-untyped-call]  # untyped in prometheus_client


class _LiveState(Collector):
    """The gauges read at scrape time from the job manager and the store's counts (set by `Metrics.render`)."""

    def __init__(self) -> None:
        self.manager: JobManager | None = None
        self.jobs_by_state: dict[str, int] = {}
        self.deliveries_by_state: dict[str, int] = {}

    def collect(self) -> Iterator[Metric]:
        manager = self.manager
        if manager is None:
            return
        replicas = manager.replicas()
        yield GaugeMetricFamily(
            "h3serve_queue_depth", "Jobs waiting for the engine (the running one excluded).", manager.queue_depth
        )
        jobs = GaugeMetricFamily("h3serve_jobs", "Stored jobs by state.", labels=["state"])
        for state in JOB_STATUSES:
            jobs.add_metric([state], self.jobs_by_state.get(state, 0))
        yield jobs
        deliveries = GaugeMetricFamily("h3serve_webhook_deliveries", "Webhook deliveries in the outbox by state "
                                       "(every server's, on a shared store).", labels=["state"])
        for delivery_state in DELIVERY_STATES:
            deliveries.add_metric([delivery_state], self.deliveries_by_state.get(delivery_state, 0))
        yield deliveries
        yield GaugeMetricFamily(
            "h3serve_engine_up", "Whether the engine's rank processes and the job runner are alive.",
            int(manager.healthy()),
        )
        up = GaugeMetricFamily(
            "h3serve_replica_up", "Whether an engine replica's rank processes and job runner are alive.",
            labels=["replica"],
        )
        busy = GaugeMetricFamily("h3serve_replica_busy", "Whether an engine replica is running a job or a real-time "
                                 "session.", labels=["replica"])
        served = CounterMetricFamily("h3serve_replica_jobs_served", "Jobs an engine replica has run (any outcome).",
                                     labels=["replica"])
        for r in replicas:
            up.add_metric([str(r.index)], int(r.problem is None))
            busy.add_metric([str(r.index)], int(r.busy))
            served.add_metric([str(r.index)], r.jobs_served)
        yield from (up, busy, served)
        yield from _engine_counters(replicas)


def _engine_counters(replicas: list[ReplicaStatus]) -> Iterator[Metric]:
    """Each replica's engine totals as of its last finished job (`ModelRunner.counters`, the executor's loads):
    a dashboard, or a test, sees that switching LoRA adapters reloads and recompiles nothing."""
    loads = CounterMetricFamily("h3serve_engine_loads", "Times a replica's rank processes loaded the model "
                                "(start-up and every restart), as of its last finished job.", labels=["replica"])
    adapters = CounterMetricFamily(
        "h3serve_lora_adapter_loads", "LoRA adapters loaded by a replica: files read into host memory "
        "(memory=host), factors placed for the device (memory=device: a device-cache fill, or an offloaded DiT's "
        "blocks rewritten); switching between cached adapters loads nothing.", labels=["replica", "memory"])
    graphs = CounterMetricFamily("h3serve_compiled_graphs", "torch.compile graphs a replica's rank 0 built "
                                 "(each recompilation adds one; 0 when the DiT runs eagerly).", labels=["replica"])
    prompts = CounterMetricFamily("h3serve_prompt_cache_lookups", "Prompt-cache lookups of a replica's rank 0: "
                                  "result=hit skipped the text encoder, result=miss ran it.",
                                  labels=["replica", "result"])
    for r in replicas:
        if not r.counters:  # no finished job yet
            continue
        replica = str(r.index)
        loads.add_metric([replica], r.counters.get("engine_loads", 0))
        for memory in ("host", "device"):
            adapters.add_metric([replica, memory], r.counters.get(f"lora_{memory}_loads", 0))
        graphs.add_metric([replica], r.counters.get("compiled_graphs", 0))
        for result, counter in (("hit", "prompt_cache_hits"), ("miss", "prompt_cache_misses")):
            prompts.add_metric([replica, result], r.counters.get(counter, 0))
    yield from (loads, adapters, graphs, prompts)


class Metrics:
    """Fed by the job manager (`on_job_started`, `on_job_finished`), the HTTP server (`count_request_timeout`) and the
    real-time sessions (`realtime_sessions_open`, `on_realtime_chunk`), rendered on every scrape with the live
    gauges."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self._live = _LiveState()
        self._render_lock = threading.Lock()
        self.registry.register(self._live)
        self.request_timeouts = Counter(
            "h3serve_request_timeouts",
            "Connections answered 408 and closed: request headers or body stalled (--header-timeout, --body-timeout).",
            ["phase"], registry=self.registry,
        )
        for phase in TIMEOUT_PHASES:  # both series exist from the start, at 0
            self.request_timeouts.labels(phase)
        self.queue_wait_seconds = Histogram(
            "h3serve_queue_wait_seconds", "Time from submission until an engine replica took the job.", ["replica"],
            buckets=LATENCY_BUCKETS, registry=self.registry,
        )
        self.stage_seconds = Histogram(
            "h3serve_stage_duration_seconds", "Duration of each generation stage of finished jobs.", ["stage"],
            buckets=LATENCY_BUCKETS, registry=self.registry,
        )
        self.job_seconds = Histogram(
            "h3serve_job_duration_seconds", "Wall time of a job from start to finish (queue time excluded).",
            ["status"], buckets=LATENCY_BUCKETS, registry=self.registry,
        )
        self._uploads()
        self._realtime()
        self._webhooks()

    def _webhooks(self) -> None:
        """This server's webhook delivery attempts (h3serve/engine/outbox), each series present from the start."""
        self.webhook_attempts = Counter(
            "h3serve_webhook_attempts", "Webhook delivery attempts this server made, by outcome.", ["outcome"],
            registry=self.registry,
        )
        for outcome in ATTEMPT_OUTCOMES:
            self.webhook_attempts.labels(outcome)
        self.webhook_attempt_seconds = Histogram(
            "h3serve_webhook_attempt_seconds", "Duration of one webhook delivery attempt (until the receiver answered "
            "or the attempt failed).", buckets=LATENCY_BUCKETS, registry=self.registry,
        )
        self.webhook_delivery_seconds = Histogram(
            "h3serve_webhook_delivery_seconds", "Time from a webhook event (a job's end) until a receiver accepted it, "
            "retries included.", buckets=LATENCY_BUCKETS, registry=self.registry,
        )
        self.webhook_given_up = Counter(
            "h3serve_webhook_given_up", "Webhook deliveries this server marked failed after their retry horizon.",
            registry=self.registry,
        )

    def on_webhook_attempt(self, outcome: str, seconds: float) -> None:
        self.webhook_attempts.labels(outcome).inc()
        self.webhook_attempt_seconds.observe(seconds)

    def on_webhook_delivered(self, latency_s: float) -> None:
        self.webhook_delivery_seconds.observe(max(0.0, latency_s))

    def on_webhook_given_up(self) -> None:
        self.webhook_given_up.inc()

    def _uploads(self) -> None:
        """The output store's series (a bucket: --output-store s3://...), each present from the start."""
        self.upload_bytes = Counter(
            "h3serve_output_upload_bytes", "Bytes of job outputs uploaded to the output store's bucket.",
            registry=self.registry,
        )
        self.upload_seconds = Histogram(
            "h3serve_output_upload_seconds", "Time to upload one output file to the bucket.",
            buckets=LATENCY_BUCKETS, registry=self.registry,
        )
        self.upload_failures = Counter(
            "h3serve_output_upload_failures", "Failed attempts at putting a job's outputs into the bucket: retried "
            "after a backoff, or failed (the job failed).", ["outcome"], registry=self.registry,
        )
        for outcome in UPLOAD_OUTCOMES:
            self.upload_failures.labels(outcome)

    def on_upload(self, outcome: str, size: int, seconds: float) -> None:
        """A file went up to the bucket ("uploaded"), or an attempt at a job's files failed."""
        if outcome == "uploaded":
            self.upload_bytes.inc(size)
            self.upload_seconds.observe(seconds)
        else:
            self.upload_failures.labels(outcome).inc()

    def _realtime(self) -> None:
        """The real-time sessions' series (WS /v1/realtime/video), each present from the start."""
        self.realtime_sessions_open = Gauge(
            "h3serve_realtime_sessions_open", "WS /v1/realtime/video sessions holding a replica now.",
            registry=self.registry,
        )
        self.realtime_chunks_sent = Counter(
            "h3serve_realtime_chunks_sent", "Segments real-time sessions sent (media chunks and trailers).", ["kind"],
            registry=self.registry,
        )
        for kind in CHUNK_KINDS:
            self.realtime_chunks_sent.labels(kind)
        self.realtime_first_chunk_seconds = Histogram(
            "h3serve_realtime_first_chunk_seconds", "Time from a session's session.start to its first chunk sent.",
            buckets=LATENCY_BUCKETS, registry=self.registry,
        )
        self.realtime_chunk_seconds = Histogram(
            "h3serve_realtime_chunk_seconds", "Time between a real-time session's consecutive chunks sent.",
            buckets=LATENCY_BUCKETS, registry=self.registry,
        )
        self.realtime_factor = Histogram(
            "h3serve_realtime_factor", "A chunk's interval over the duration of its media (below 1: faster than "
            "real time).", buckets=REALTIME_FACTOR_BUCKETS, registry=self.registry,
        )

    def on_realtime_chunk(self, kind: str, interval_s: float, media_s: float, first: bool) -> None:
        """A session sent a chunk: `interval_s` after its previous one (the first: after session.start)."""
        self.realtime_chunks_sent.labels(kind).inc()
        if kind != "media":
            return
        if first:
            self.realtime_first_chunk_seconds.observe(interval_s)
        else:
            self.realtime_chunk_seconds.observe(interval_s)
            self.realtime_factor.observe(interval_s / media_s)

    def count_request_timeout(self, phase: str) -> None:
        self.request_timeouts.labels(phase).inc()

    def on_job_started(self, replica: int, queue_wait_s: float) -> None:
        self.queue_wait_seconds.labels(str(replica)).observe(queue_wait_s)

    def on_job_finished(self, job: Job) -> None:
        for stage, seconds in job.stage_durations.items():
            self.stage_seconds.labels(stage).observe(seconds)
        if job.inference_time_s is not None:
            self.job_seconds.labels(job.status).observe(job.inference_time_s)

    def render(self, manager: JobManager, jobs_by_state: dict[str, int],
               deliveries_by_state: dict[str, int] | None = None) -> str:
        with self._render_lock:  # the live collector reads what this scrape passed in
            self._live.manager, self._live.jobs_by_state = manager, jobs_by_state
            self._live.deliveries_by_state = deliveries_by_state or {}
            return prometheus_client.generate_latest(self.registry).decode()
