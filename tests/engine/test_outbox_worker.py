"""The webhook delivery worker (h3serve/engine/outbox/outbox_worker.py) on a SQLite store and a scripted receiver:
woken by a finished job, retrying under one webhook-id until the horizon, then giving up; a deleted endpoint's
delivery failed; a store outage survived."""

from __future__ import annotations

import logging
import random
from pathlib import Path

import pytest
from waiting import wait_until
from webhook_receiver import receiver

from h3serve.engine.outbox.outbox_worker import OutboxWorker
from h3serve.engine.outbox.retry import RetryPolicy
from h3serve.engine.outbox.sender import AllowedHost, WebhookSender, WebhookURLGuard
from h3serve.jobstore import open_job_store
from h3serve.jobstore.records import Job
from h3serve.jobstore.webhook_records import WebhookEndpoint, new_endpoint_id, new_secret, secret_hint
from h3serve.jobstore.webhook_sql import ENDPOINT_DELETED
from h3serve.rules.request import GenerationRequest


class Observer:
    def __init__(self) -> None:
        self.outcomes: list[str] = []
        self.delivered: list[float] = []
        self.given_up = 0

    def on_webhook_attempt(self, outcome: str, seconds: float) -> None:
        self.outcomes.append(outcome)

    def on_webhook_delivered(self, latency_s: float) -> None:
        self.delivered.append(latency_s)

    def on_webhook_given_up(self) -> None:
        self.given_up += 1


@pytest.fixture
def setup(tmp_path: Path):
    """(store, receiver, endpoint, make_worker, finish_job)."""
    store = open_job_store(tmp_path / "jobs.sqlite3")
    with receiver() as rx:
        secret = new_secret()
        hook = store.insert_endpoint(WebhookEndpoint(
            id=new_endpoint_id(), key_scope="", name="n", url=rx.url, event_types=("video.completed",),
            created_at=1, updated_at=1, secret=secret, secret_hint=secret_hint(secret)), 10)
        workers: list[OutboxWorker] = []

        def worker(retry: RetryPolicy, poll_s: float = 0.05) -> tuple[OutboxWorker, Observer]:
            observer = Observer()
            sender = WebhookSender(WebhookURLGuard([AllowedHost.parse(rx.host)]), timeout_s=2.0)
            made = OutboxWorker(store, sender, "me", 30.0, retry=retry, poll_s=poll_s, observer=observer,
                                rng=random.Random(56))
            made.start()
            workers.append(made)
            return made, observer

        def finish_job() -> str:
            job = store.insert(Job(id=f"video_{len(store.ids()):032d}", model="tiny",
                                   request=GenerationRequest(prompt="p"), created_at=1, size="128x64", seconds="4",
                                   num_frames=107, fps=24, duration_s=107 / 24))
            store.claim("me", 30)
            assert store.finish(job.id, "me", status="completed")
            return job.id

        try:
            yield store, rx, hook, worker, finish_job
        finally:
            for made in workers:
                assert made.stop(10)
            store.close()


def state(store, video_id: str):
    [delivery] = store.deliveries_for_video("", video_id)
    return delivery


def test_a_finished_job_wakes_the_worker_and_the_delivery_is_recorded(setup):
    store, rx, hook, worker, finish_job = setup
    outbox, observer = worker(RetryPolicy(), poll_s=600)  # it would not poll again within the test
    video_id = finish_job()
    outbox.wake(store.get(video_id))  # as the job manager's listener calls it, with the job
    [got] = rx.wait_for(1)
    delivered = wait_until(lambda: (d := state(store, video_id)).state == "delivered" and d, what="recorded")
    assert (delivered.attempts, delivered.last_status_code, delivered.id) == (1, 200, got.headers["webhook-id"])
    wait_until(lambda: observer.delivered, what="the delivery observed")
    assert observer.outcomes == ["delivered"] and len(observer.delivered) == 1


def test_a_delivery_is_retried_under_one_id_until_its_horizon_then_given_up(setup, caplog):
    caplog.set_level(logging.INFO, logger="h3serve.webhooks")
    store, rx, hook, worker, finish_job = setup
    rx.answer(*[500] * 50)
    video_id = finish_job()
    # The horizon counts from the event's whole second: 2 s leave at least one retry however late it started.
    _, observer = worker(RetryPolicy(initial_s=0.05, max_s=0.1, horizon_s=2.0))
    failed = wait_until(lambda: (d := state(store, video_id)).state == "failed" and d, timeout_s=20,
                        what="given up")
    assert failed.attempts == len(rx.received) >= 2 and failed.last_status_code == 500
    assert failed.last_error == "the receiver answered HTTP 500: ok"
    wait_until(lambda: observer.given_up, what="the given-up delivery observed")
    assert len({r.headers["webhook-id"] for r in rx.received}) == 1 and observer.given_up == 1
    assert set(observer.outcomes) == {"http_error"}
    logged = caplog.text
    assert "failed for good after" in logged and hook.id in logged and hook.secret not in logged  # no secret logged


def test_a_deleted_endpoints_delivery_fails_and_a_store_outage_is_survived(setup, monkeypatch):
    store, rx, hook, worker, finish_job = setup
    calls = {"n": 0}
    claim = store.claim_deliveries

    def flaky_claim(*args):
        calls["n"] += 1
        if calls["n"] <= 3:
            raise OSError("the database is away")
        return claim(*args)

    monkeypatch.setattr(store, "claim_deliveries", flaky_claim)
    rx.answer(503)
    first = finish_job()
    worker(RetryPolicy(initial_s=60.0))  # the retry comes after the test
    wait_until(lambda: state(store, first).attempts == 1 and state(store, first).owner is None, what="attempted")
    assert calls["n"] > 3  # it kept polling through the outage
    assert store.delete_endpoint("", hook.id)
    assert (state(store, first).state, state(store, first).last_error) == ("failed", ENDPOINT_DELETED)
    assert len(rx.received) == 1
