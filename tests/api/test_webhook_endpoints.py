"""Webhooks through the official OpenAI SDK, unmodified, against a live server (the real app, store and job manager
on a fake engine): endpoints created, listed, updated, rotated, tested and deleted; a finished video's event
delivered, signed so that `client.webhooks.unwrap` verifies it and refuses a tampered body; a failing receiver
retried under one webhook-id until it recovers; URLs the server may not reach refused."""

from __future__ import annotations

import json
import time

import openai
import pytest
from api_servers import API_KEY
from fake_executor import FAIL_PROMPT
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families
from waiting import wait_until
from webhook_receiver import receiver
from webhook_servers import serve_webhooks

pytestmark = pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning")
VIDEO = {"prompt": "rain on a tin roof", "seconds": "4", "size": "128x64", "extra_body": {"num_inference_steps": 2}}


@pytest.fixture(scope="module")
def hooks(tmp_path_factory):
    with receiver() as rx, serve_webhooks(tmp_path_factory.mktemp("data"), webhook_allow_hosts=(rx.host,)) as server:
        yield server, rx, OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture
def fresh(hooks):
    """The module's server, its receiver (nothing received, nothing scripted) and an SDK client; no endpoint."""
    server, rx, client = hooks
    for endpoint in client.webhooks.list():
        client.webhooks.delete(endpoint.id)
    rx.received.clear()
    rx.answer()
    return server, rx, client


def refused(call, status: int = 400) -> dict:
    with pytest.raises(openai.APIStatusError) as e:
        call()
    assert e.value.status_code == status, e.value.body
    return e.value.body


def test_the_sdk_creates_lists_updates_rotates_tests_and_deletes_endpoints(fresh):
    server, rx, client = fresh
    assert client.webhooks.event_types.list().data == ["video.completed", "video.failed"]
    body = refused(lambda: client.webhooks.create(name="x", url=rx.url,
                                                  event_types=["video.completed", "batch.completed"]))
    assert body["param"] == "event_types" and "'batch.completed'" in body["message"]

    made = [client.webhooks.create(name=f"hook {i}", url=rx.url, event_types=["video.completed"]) for i in range(3)]
    first = made[0]
    assert first.object == "webhook_endpoint" and first.signing_secret.startswith("whsec_")
    assert first.signing_secret_hint == f"whsec_...{first.signing_secret[-4:]}" and first.updated_at == first.created_at
    listed = list(client.webhooks.list(limit=2))  # the SDK follows the cursor over two pages
    assert [e.id for e in listed] == [e.id for e in reversed(made)]
    assert not any("signing_secret" in e.model_dump(exclude_none=True) for e in listed)  # shown once, at creation
    got = client.webhooks.retrieve(first.id)
    assert (got.name, got.url, got.event_types) == ("hook 0", rx.url, ["video.completed"])

    assert client.webhooks.update(first.id, name="hook 0").updated_at == first.updated_at  # nothing changed
    updated = client.webhooks.update(first.id, name="renamed", event_types=["video.failed", "video.completed"])
    assert updated.name == "renamed" and updated.event_types == ["video.completed", "video.failed"]
    assert updated.updated_at >= first.updated_at and updated.url == rx.url  # (whole seconds: the store test times)

    rotated = client.webhooks.rotate_secret(first.id, keep_old_secret_active_for_24_hours=True)
    assert rotated.signing_secret != first.signing_secret and rotated.signing_secret_hint != first.signing_secret_hint
    result = client.webhooks.test(first.id, event_type="video.failed")
    assert (result.object, result.success, result.status_code, result.event_type, result.webhook_endpoint_id) == (
        "webhook_endpoint.test", True, 200, "video.failed", first.id)
    [sample] = rx.received
    for secret in (rotated.signing_secret, first.signing_secret):  # the old secret's 24 h grace
        event = client.webhooks.unwrap(sample.body, sample.headers, secret=secret)
        assert event.type == "video.failed" and event.object == "event" and event.data.id.startswith("video_test")
    client.webhooks.rotate_secret(first.id)  # the old one invalid at once
    client.webhooks.test(first.id, event_type="video.completed")
    with pytest.raises(openai.InvalidWebhookSignatureError):
        client.webhooks.unwrap(rx.received[1].body, rx.received[1].headers, secret=rotated.signing_secret)
    rx.answer(418)
    assert client.webhooks.test(first.id, event_type="video.completed").status_code == 418
    assert refused(lambda: client.webhooks.test(first.id, event_type="batch.completed"))["param"] == "event_type"

    deleted = client.webhooks.delete(first.id)
    assert (deleted.id, deleted.deleted, deleted.object) == (first.id, True, "webhook_endpoint.deleted")
    for call in (lambda: client.webhooks.retrieve(first.id), lambda: client.webhooks.delete(first.id),
                 lambda: client.webhooks.update(first.id, name="x"), lambda: client.webhooks.rotate_secret(first.id),
                 lambda: client.webhooks.test(first.id, event_type="video.completed")):
        assert refused(call, 404)["code"] == "webhook_endpoint_not_found"
    assert len(list(client.webhooks.list())) == 2
    paths = server.client().get("/openapi.json").json()["paths"]
    for path, method in (("/v1/webhook_endpoints", "post"), ("/v1/webhook_endpoints", "get"),
                         ("/v1/webhook_endpoints/{webhook_endpoint_id}", "post"),
                         ("/v1/webhook_endpoints/{webhook_endpoint_id}/rotate_secret", "post"),
                         ("/v1/webhook_endpoints/{webhook_endpoint_id}/test", "post"),
                         ("/v1/webhook_event_types", "get"), ("/v1/videos/{video_id}/webhook_deliveries", "get")):
        assert paths[path][method]["tags"] == ["webhooks"], (path, method)
    anonymous = OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0)
    assert refused(lambda: anonymous.webhooks.list(), 401)["code"] == "invalid_api_key"
    assert API_KEY not in server.client().get("/v1/webhook_endpoints").text


def test_a_finished_video_is_delivered_signed_and_a_tampered_body_is_refused(fresh):
    server, rx, client = fresh
    hook = client.webhooks.create(name="jobs", url=rx.url, event_types=["video.completed", "video.failed"])
    video = client.videos.create(**VIDEO)
    failed = client.videos.create(**{**VIDEO, "prompt": FAIL_PROMPT})
    deliveries = rx.wait_for(2)
    events = {}
    for got in deliveries:
        event = client.webhooks.unwrap(got.body, got.headers, secret=hook.signing_secret)
        events[event.data.id] = event
        tampered = got.body.replace(event.data.id.encode(), b"video_" + b"0" * 32)
        with pytest.raises(openai.InvalidWebhookSignatureError):
            client.webhooks.unwrap(tampered, got.headers, secret=hook.signing_secret)
    assert {v: e.type for v, e in events.items()} == {video.id: "video.completed", failed.id: "video.failed"}
    done = client.videos.retrieve(video.id)
    assert done.status == "completed" and events[video.id].created_at == done.completed_at
    assert events[video.id].object == "event" and events[video.id].id.startswith("evt_")
    assert hook.signing_secret not in json.dumps(done.model_dump()) + server.client().get("/metrics").text

    [view] = wait_until(lambda: [d for d in server.client().get(f"/v1/videos/{video.id}/webhook_deliveries").json()
                                 ["data"] if d["state"] == "delivered"], what="the delivery recorded")
    assert (view["id"], view["attempts"], view["last_status_code"], view["webhook_endpoint_id"]) == (
        rx.received[[json.loads(r.body)["data"]["id"] for r in rx.received].index(video.id)].headers["webhook-id"],
        1, 200, hook.id)
    samples = {(s.name, tuple(s.labels.values())): s.value for f in text_string_to_metric_families(
        server.client().get("/metrics").text) for s in f.samples}
    assert samples[("h3serve_webhook_attempts_total", ("delivered",))] >= 2
    assert samples[("h3serve_webhook_delivery_seconds_count", ())] >= 2


def test_a_failing_receiver_gets_every_attempt_under_one_webhook_id_until_it_recovers(fresh):
    server, rx, client = fresh
    hook = client.webhooks.create(name="flaky", url=rx.url, event_types=["video.completed"])
    rx.answer(500, 503, 429)  # fails three times, then accepts
    video = client.videos.create(**VIDEO)
    attempts = rx.wait_for(4)
    assert len({a.headers["webhook-id"] for a in attempts}) == 1  # the receiver can drop repeats by it
    assert len({a.body for a in attempts}) == 1  # the same event, byte for byte
    for got in attempts:  # each attempt signed afresh: every one verifies
        assert client.webhooks.unwrap(got.body, got.headers, secret=hook.signing_secret).data.id == video.id
    delivered = wait_until(lambda: (d := server.client().get(f"/v1/videos/{video.id}/webhook_deliveries").json()
                                    ["data"][0])["state"] == "delivered" and d, what="the delivery recorded")
    assert (delivered["attempts"], delivered["last_status_code"], delivered["last_error"]) == (4, 200, None)
    time.sleep(0.3)  # a few more polls of the worker: nothing is sent again
    assert len(rx.received) == 4


def test_urls_the_server_may_not_reach_are_refused(fresh, monkeypatch):
    server, rx, client = fresh
    for url, why in (("http://127.0.0.1:9/hook", "must use https"), ("https://127.0.0.1/hook", "loopback"),
                     ("https://10.0.0.5/hook", "private"), ("https://169.254.169.254/hook", "link-local")):
        body = refused(lambda url=url: client.webhooks.create(name="x", url=url, event_types=["video.completed"]))
        assert (body["param"], body["code"]) == ("url", "invalid_url") and why in body["message"], body

    async def to_loopback(host: str, port: int) -> list[str]:
        return ["127.0.0.1"]

    monkeypatch.setattr(server.app.state.context.outbox.sender.guard, "resolver", to_loopback)
    body = refused(lambda: client.webhooks.create(name="x", url="https://hooks.example.com/x",
                                                  event_types=["video.completed"]))
    assert "'hooks.example.com' resolves to a loopback address" in body["message"]
    hook = client.webhooks.create(name="ok", url=rx.url, event_types=["video.completed"])
    assert refused(lambda: client.webhooks.update(hook.id, url="https://hooks.example.com/x"))["param"] == "url"
    rx.redirect_to = f"http://127.0.0.1:{rx.port + 1}/elsewhere"  # loopback, but not the allowed port
    rx.answer(307)
    body = refused(lambda: client.webhooks.test(hook.id, event_type="video.completed"))
    assert body["code"] == "webhook_test_failed" and "must use https" in body["message"]
    assert len(rx.received) == 1 and hook.signing_secret not in json.dumps(body)

