"""/metrics keeps its names and labels (dashboards keep working) now that prometheus_client writes it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from prometheus_client.parser import text_string_to_metric_families

from h3serve.api.prometheus import LATENCY_BUCKETS, Metrics
from h3serve.jobstore.records import JOB_STATUSES

# Every series the hand-written exposition had: (sample name, label names).
HISTOGRAMS = {"h3serve_queue_wait_seconds": "replica", "h3serve_stage_duration_seconds": "stage",
              "h3serve_job_duration_seconds": "status"}
REALTIME_HISTOGRAMS = ("h3serve_realtime_first_chunk_seconds", "h3serve_realtime_chunk_seconds",
                       "h3serve_realtime_factor")
WEBHOOK_HISTOGRAMS = ("h3serve_webhook_attempt_seconds", "h3serve_webhook_delivery_seconds")
EXPECTED = {
    ("h3serve_queue_depth", ()), ("h3serve_jobs", ("state",)), ("h3serve_engine_up", ()),
    ("h3serve_replica_up", ("replica",)), ("h3serve_replica_busy", ("replica",)),
    ("h3serve_replica_jobs_served_total", ("replica",)), ("h3serve_request_timeouts_total", ("phase",)),
    ("h3serve_engine_loads_total", ("replica",)), ("h3serve_lora_adapter_loads_total", ("memory", "replica")),
    ("h3serve_compiled_graphs_total", ("replica",)), ("h3serve_prompt_cache_lookups_total", ("replica", "result")),
    *((f"{name}_bucket", ("le", label)) for name, label in HISTOGRAMS.items()),
    *((f"{name}_{part}", (label,)) for name, label in HISTOGRAMS.items() for part in ("sum", "count")),
    # the output store's uploads (--output-store s3://...)
    ("h3serve_output_upload_bytes_total", ()), ("h3serve_output_upload_failures_total", ("outcome",)),
    ("h3serve_output_upload_seconds_bucket", ("le",)),
    *((f"h3serve_output_upload_seconds_{part}", ()) for part in ("sum", "count")),
    # the real-time sessions (WS /v1/realtime/video)
    ("h3serve_realtime_sessions_open", ()), ("h3serve_realtime_chunks_sent_total", ("kind",)),
    *((f"{name}_bucket", ("le",)) for name in REALTIME_HISTOGRAMS),
    *((f"{name}_{part}", ()) for name in REALTIME_HISTOGRAMS for part in ("sum", "count")),
    # the webhook deliveries (h3serve/engine/outbox)
    ("h3serve_webhook_deliveries", ("state",)), ("h3serve_webhook_attempts_total", ("outcome",)),
    ("h3serve_webhook_given_up_total", ()),
    *((f"{name}_bucket", ("le",)) for name in WEBHOOK_HISTOGRAMS),
    *((f"{name}_{part}", ()) for name in WEBHOOK_HISTOGRAMS for part in ("sum", "count")),
}


def _scrape() -> str:
    metrics = Metrics()
    metrics.on_job_started(0, 0.3)
    metrics.on_job_finished(SimpleNamespace(stage_durations={"denoise": 1.5}, inference_time_s=2.0, status="completed"))
    metrics.count_request_timeout("body")
    counters = {"engine_loads": 1, "lora_host_loads": 2, "lora_device_loads": 3, "compiled_graphs": 4,
                "prompt_cache_hits": 5, "prompt_cache_misses": 6}
    replica = SimpleNamespace(index=0, problem=None, busy=True, jobs_served=3, counters=counters)
    fresh = SimpleNamespace(index=1, problem=None, busy=False, jobs_served=0, counters={})  # no job finished yet
    manager = SimpleNamespace(replicas=lambda: [replica, fresh], queue_depth=2, healthy=lambda: True)
    return metrics.render(manager, {"queued": 2, "completed": 1})


def test_metric_names_and_labels_are_unchanged():
    samples = [s for family in text_string_to_metric_families(_scrape()) for s in family.samples]
    assert {(s.name, tuple(sorted(s.labels))) for s in samples} == {(n, tuple(sorted(ls))) for n, ls in EXPECTED}
    values = {(s.name, tuple(sorted(s.labels.items()))): s.value for s in samples}
    assert values[("h3serve_queue_depth", ())] == 2
    assert [values[("h3serve_jobs", (("state", state),))] for state in JOB_STATUSES] == [
        {"queued": 2, "completed": 1}.get(state, 0) for state in JOB_STATUSES]
    assert values[("h3serve_request_timeouts_total", (("phase", "body"),))] == 1
    assert values[("h3serve_request_timeouts_total", (("phase", "headers"),))] == 0
    assert values[("h3serve_replica_jobs_served_total", (("replica", "0"),))] == 3
    assert values[("h3serve_engine_loads_total", (("replica", "0"),))] == 1
    assert values[("h3serve_lora_adapter_loads_total", (("memory", "host"), ("replica", "0")))] == 2
    assert values[("h3serve_lora_adapter_loads_total", (("memory", "device"), ("replica", "0")))] == 3
    assert values[("h3serve_compiled_graphs_total", (("replica", "0"),))] == 4
    assert values[("h3serve_prompt_cache_lookups_total", (("replica", "0"), ("result", "hit")))] == 5
    assert values[("h3serve_prompt_cache_lookups_total", (("replica", "0"), ("result", "miss")))] == 6
    assert ("h3serve_engine_loads_total", (("replica", "1"),)) not in values  # counted from its first job
    buckets = sorted(float(s.labels["le"]) for s in samples if s.name == "h3serve_stage_duration_seconds_bucket")
    assert buckets == [*map(float, LATENCY_BUCKETS), float("inf")]
    assert values[("h3serve_stage_duration_seconds_bucket", (("le", "2.5"), ("stage", "denoise")))] == 1
    assert values[("h3serve_stage_duration_seconds_bucket", (("le", "1.0"), ("stage", "denoise")))] == 0
    assert values[("h3serve_job_duration_seconds_sum", (("status", "completed"),))] == 2.0


def test_two_servers_in_one_process_count_apart():
    first, second = Metrics(), Metrics()
    first.count_request_timeout("headers")
    manager = SimpleNamespace(replicas=lambda: [], queue_depth=0, healthy=lambda: True)
    assert 'h3serve_request_timeouts_total{phase="headers"} 0.0' in second.render(manager, {})


def test_realtime_chunks_feed_their_histograms():
    metrics = Metrics()
    metrics.realtime_sessions_open.inc()
    metrics.on_realtime_chunk("media", 3.0, 34 / 24, first=True)
    metrics.on_realtime_chunk("media", 0.7, 34 / 24, first=False)
    metrics.on_realtime_chunk("trailer", 0.01, 0.0, first=False)
    manager = SimpleNamespace(replicas=lambda: [], queue_depth=0, healthy=lambda: True)
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(metrics.render(manager, {})) for s in family.samples}
    assert samples[("h3serve_realtime_sessions_open", ())] == 1
    assert samples[("h3serve_realtime_chunks_sent_total", (("kind", "media"),))] == 2
    assert samples[("h3serve_realtime_chunks_sent_total", (("kind", "trailer"),))] == 1
    assert samples[("h3serve_realtime_first_chunk_seconds_sum", ())] == 3.0
    assert samples[("h3serve_realtime_chunk_seconds_count", ())] == 1  # the first chunk and the trailer: not here
    assert samples[("h3serve_realtime_factor_sum", ())] == pytest.approx(0.7 / (34 / 24))


def test_uploads_feed_bytes_seconds_and_failures():
    metrics = Metrics()
    metrics.on_upload("uploaded", 1000, 0.2)
    metrics.on_upload("uploaded", 24, 0.05)
    metrics.on_upload("retried", 0, 0.0)
    metrics.on_upload("retried", 0, 0.0)
    metrics.on_upload("failed", 0, 0.0)
    manager = SimpleNamespace(replicas=lambda: [], queue_depth=0, healthy=lambda: True)
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(metrics.render(manager, {})) for s in family.samples}
    assert samples[("h3serve_output_upload_bytes_total", ())] == 1024
    assert samples[("h3serve_output_upload_seconds_count", ())] == 2
    assert samples[("h3serve_output_upload_seconds_sum", ())] == pytest.approx(0.25)
    assert samples[("h3serve_output_upload_failures_total", (("outcome", "retried"),))] == 2
    assert samples[("h3serve_output_upload_failures_total", (("outcome", "failed"),))] == 1


def test_webhook_deliveries_are_counted():
    metrics = Metrics()
    metrics.on_webhook_attempt("http_error", 0.2)
    metrics.on_webhook_attempt("delivered", 0.1)
    metrics.on_webhook_delivered(7.5)
    metrics.on_webhook_given_up()
    manager = SimpleNamespace(replicas=lambda: [], queue_depth=0, healthy=lambda: True)
    text = metrics.render(manager, {}, {"pending": 3, "delivered": 1})
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(text) for s in family.samples}
    assert [samples[("h3serve_webhook_deliveries", (("state", s),))] for s in ("pending", "delivered", "failed")] == [
        3, 1, 0]
    assert samples[("h3serve_webhook_attempts_total", (("outcome", "http_error"),))] == 1
    assert samples[("h3serve_webhook_attempts_total", (("outcome", "timeout"),))] == 0
    assert samples[("h3serve_webhook_attempt_seconds_count", ())] == 2
    assert samples[("h3serve_webhook_delivery_seconds_sum", ())] == 7.5
    assert samples[("h3serve_webhook_given_up_total", ())] == 1
