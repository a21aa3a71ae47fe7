"""The webhook half of the job store, on SQLite and on a real PostgreSQL: endpoints under their API key, the outbox
written in the transaction of a job's final state (never one without the other), and deliveries claimed under a
lease (a dead server's taken over, a lost lease's result never recorded)."""

from __future__ import annotations

import dataclasses
import json
import threading

import pytest
from test_store import make_job

from h3serve.jobstore import open_job_store, sql
from h3serve.jobstore.webhook_records import (
    WebhookEndpoint,
    new_endpoint_id,
    new_secret,
    secret_hint,
)
from h3serve.jobstore.webhook_sql import ENDPOINT_DELETED

BOTH = ("video.completed", "video.failed")


def endpoint(scope: str = "k1", types: tuple[str, ...] = BOTH, created_at: int = 100) -> WebhookEndpoint:
    secret = new_secret()
    return WebhookEndpoint(id=new_endpoint_id(), key_scope=scope, name="n", url="https://example.com/hook",
                           event_types=types, created_at=created_at, updated_at=created_at, secret=secret,
                           secret_hint=secret_hint(secret))


def finished_job(store, scope: str = "k1", status: str = "completed", owner: str = "a", **job) -> str:
    """A job of `scope` claimed by `owner` and finished with `status`; its id."""
    made = make_job(**job)
    queued = store.insert(dataclasses.replace(made, key_scope=scope, owner=owner if made.sync else None))
    assert store.claim(owner, 30).id == queued.id
    assert store.finish(queued.id, owner, status=status, completed_at=1234)
    return queued.id


def deliveries(store) -> list[dict]:
    return [dict(row) for row in store._run("SELECT * FROM webhook_deliveries ORDER BY seq")]


def test_a_finished_job_writes_one_event_for_each_subscribed_endpoint_of_its_key(store):
    both = store.insert_endpoint(endpoint(), 10)
    completed_only = store.insert_endpoint(endpoint(types=("video.completed",)), 10)
    store.insert_endpoint(endpoint(scope="k2"), 10)  # another key's: never told of k1's jobs
    queued = store.insert(dataclasses.replace(make_job(), key_scope="k1"))
    store.claim("a", 30)
    assert not store.finish(queued.id, "b", status="completed")  # not its owner: no outcome, no event
    assert deliveries(store) == []
    assert store.finish(queued.id, "a", status="completed", completed_at=1234)
    assert not store.finish(queued.id, "a", status="completed")  # recorded once: one event
    rows = deliveries(store)
    assert {r["endpoint_id"] for r in rows} == {both.id, completed_only.id}
    assert len({r["event_id"] for r in rows}) == 1 and len({r["id"] for r in rows}) == 2  # one event, two deliveries
    body = json.loads(rows[0]["payload"])
    assert body == {"object": "event", "id": rows[0]["event_id"], "type": "video.completed", "created_at": 1234,
                    "data": {"id": queued.id}}
    assert {(r["state"], r["attempts"], r["video_id"], r["key_scope"]) for r in rows} == {
        ("pending", 0, queued.id, "k1")}

    failed = finished_job(store, status="failed")
    assert [(r["endpoint_id"], r["event_type"]) for r in deliveries(store) if r["video_id"] == failed] == [
        (both.id, "video.failed")]
    finished_job(store, scope="k3")  # a key without endpoints
    finished_job(store, sync=True)  # a sync job: its client holds the answer
    assert len(deliveries(store)) == 3


def test_cancelling_and_failing_at_start_up_send_video_failed_once(store):
    """A deleted unfinished job (h3serve's cancel) sends video.failed (the SDK names no cancellation event for
    videos); deleting a finished one sends nothing more. A recovery's `update` to failed sends it once too."""
    hook = store.insert_endpoint(endpoint(), 10)
    queued = store.insert(dataclasses.replace(make_job(), key_scope="k1"))
    assert store.delete(queued.id) and not store.delete(queued.id)
    done = finished_job(store)
    assert store.delete(done)
    stuck = store.insert(dataclasses.replace(make_job(), key_scope="k1"))
    store.update(stuck.id, status="failed", completed_at=99)
    store.update(stuck.id, status="failed", completed_at=99)  # already failed: no second event
    store.update(stuck.id, progress=5)
    events = [(r["video_id"], r["event_type"], json.loads(r["payload"])["created_at"]) for r in deliveries(store)]
    assert [e[:2] for e in events] == [
        (queued.id, "video.failed"), (done, "video.completed"), (stuck.id, "video.failed")]
    assert events[2][2] == 99 and {r["endpoint_id"] for r in deliveries(store)} == {hook.id}


def test_an_outcome_is_never_recorded_without_its_event(store, monkeypatch):
    """The outbox write shares the transaction of the job's final state: when it fails, the job stays unfinished
    (its lease runs out and it is run again), rather than finishing without its event."""
    store.insert_endpoint(endpoint(), 10)
    queued = store.insert(dataclasses.replace(make_job(), key_scope="k1"))
    store.claim("a", 30)

    def broken(run, job, now):
        run("UPDATE jobs SET progress = 77 WHERE id = ?", (job["id"],))  # a statement of the transaction ran
        raise RuntimeError("the outbox write failed")

    monkeypatch.setattr(sql, "queue_job_event", broken)
    with pytest.raises(RuntimeError):
        store.finish(queued.id, "a", status="completed")
    with pytest.raises(RuntimeError):
        store.delete(queued.id)
    job = store.get(queued.id)
    assert (job.status, job.completions, job.owner, job.progress) == ("in_progress", 0, "a", 0)
    assert deliveries(store) == []
    monkeypatch.undo()
    assert store.finish(queued.id, "a", status="completed") and len(deliveries(store)) == 1


def test_deliveries_are_leased_and_a_dead_servers_are_taken_over(store):
    store.insert_endpoint(endpoint(), 10)
    finished_job(store)
    [(mine, hook)] = store.claim_deliveries("a", -1.0, 5)  # leased, but (lease -1 s) as if server a had died
    assert (mine.owner, mine.attempts, hook.id) == ("a", 1, mine.endpoint_id)
    [(taken, _)] = store.claim_deliveries("b", 30.0, 5)  # a's lease ran out: b takes the delivery over
    assert (taken.id, taken.owner, taken.attempts, taken.payload) == (mine.id, "b", 2, mine.payload)
    assert store.claim_deliveries("a", 30.0, 5) == []  # b holds it now
    assert not store.record_delivered(mine.id, "a", 200)  # a's late answer is not recorded
    assert not store.record_attempt_failed(mine.id, "a", 500, "HTTP 500", 0.0)
    assert store.record_delivered(taken.id, "b", 204)
    [row] = deliveries(store)
    assert (row["state"], row["attempts"], row["last_status_code"], row["owner"]) == ("delivered", 2, 204, None)
    assert store.claim_deliveries("b", 30.0, 5) == [] and store.count_deliveries_by_state() == {"delivered": 1}


def test_failed_attempts_wait_for_their_retry_then_give_up(store):
    store.insert_endpoint(endpoint(), 10)
    finished_job(store)
    [(first, _)] = store.claim_deliveries("a", 30.0, 5)
    assert store.record_attempt_failed(first.id, "a", 503, "the receiver answered HTTP 503", 4e9)  # far ahead
    assert store.claim_deliveries("a", 30.0, 5) == []  # not due yet
    store._run("UPDATE webhook_deliveries SET next_attempt_at = 0")
    [(second, _)] = store.claim_deliveries("a", 30.0, 5)
    assert second.attempts == 2 and second.last_error == "the receiver answered HTTP 503"
    assert store.record_attempt_failed(second.id, "a", None, "timeout", None)  # past the horizon
    assert store.claim_deliveries("a", 30.0, 5) == []
    assert store.deliveries_for_video("k1", second.video_id)[0].state == "failed"
    assert store.deliveries_for_video("k2", second.video_id) == []  # another key sees none


def test_a_restarted_single_server_releases_its_leases(tmp_path):
    """SQLite, one server: its next start takes back what a killed process held (a shared store waits for the
    lease instead)."""
    target = tmp_path / "jobs.sqlite3"
    store = open_job_store(target)
    store.insert_endpoint(endpoint(), 10)
    finished_job(store)
    assert len(store.claim_deliveries("killed", 3600.0, 5)) == 1
    store.close()
    store = open_job_store(target)
    assert store.claim_deliveries("restarted", 30.0, 5) == []  # leased for an hour
    store.release_deliveries()
    [(delivery, _)] = store.claim_deliveries("restarted", 30.0, 5)
    assert delivery.attempts == 2  # the killed process's attempt counts
    store.close()


def test_concurrent_claims_never_share_a_delivery(target):
    stores = [open_job_store(target) for _ in range(2)]
    stores[0].insert_endpoint(endpoint(), 10)
    for _ in range(12):
        finished_job(stores[0])
    got: list[list[str]] = [[], []]

    def claim(i: int) -> None:
        while batch := stores[i].claim_deliveries(f"s{i}", 30.0, 2):
            got[i] += [d.id for d, _ in batch]

    threads = [threading.Thread(target=claim, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(got[0]) + len(got[1]) == 12 and not set(got[0]) & set(got[1])
    for s in stores:
        s.close()


def test_endpoints_are_paged_updated_rotated_and_deleted_under_their_key(store):
    made = [store.insert_endpoint(endpoint(), 3) for _ in range(3)]
    assert store.insert_endpoint(endpoint(), 3) is None  # the key's limit
    assert store.insert_endpoint(endpoint(scope="k2"), 3) is not None  # another key's own limit
    ids = [e.id for e in made]
    page, more = store.page_endpoints("k1", None, 2)
    assert [e.id for e in page] == ids[::-1][:2] and more  # newest first
    page, more = store.page_endpoints("k1", page[-1].id, 2)
    assert [e.id for e in page] == [ids[0]] and not more
    assert store.page_endpoints("k1", "we_unknown", 2) == ([], False)
    assert store.get_endpoint("k2", ids[0]) is None and store.update_endpoint("k2", ids[0], 500, name="x") is None

    same = store.update_endpoint("k1", ids[0], 500, name="n", event_types=BOTH)
    assert same.updated_at == 100  # nothing changed: updated_at stays
    changed = store.update_endpoint("k1", ids[0], 500, url="https://example.org/", event_types=("video.failed",))
    assert (changed.url, changed.event_types, changed.name, changed.updated_at) == (
        "https://example.org/", ("video.failed",), "n", 500)

    kept = store.rotate_endpoint_secret("k1", ids[0], "whsec_new", "whsec_...new", 600, keep_old_until=700)
    assert kept.signing_secrets(650) == ("whsec_new", made[0].secret) and kept.signing_secrets(700) == ("whsec_new",)
    assert made[0].secret not in repr(kept) and "whsec_new" not in repr(kept)  # secrets never printed
    dropped = store.rotate_endpoint_secret("k1", ids[0], "whsec_newer", "whsec_...ewer", 610, keep_old_until=None)
    assert dropped.signing_secrets(650) == ("whsec_newer",) and dropped.updated_at == 610
    store.rotate_endpoint_secret("k1", ids[1], "whsec_b", "whsec_...b", 600, keep_old_until=700)
    store.prune_webhooks(800, 10**9)  # past its grace: the old secret is forgotten
    assert store.get_endpoint("k1", ids[1]).previous_secret is None

    finished_job(store)
    assert not store.delete_endpoint("k2", ids[2]) and store.delete_endpoint("k1", ids[2])
    assert store.get_endpoint("k1", ids[2]) is None and not store.delete_endpoint("k1", ids[2])
    gone = [r for r in deliveries(store) if r["endpoint_id"] == ids[2]]
    assert [(r["state"], r["last_error"]) for r in gone] == [("failed", ENDPOINT_DELETED)]
    assert store.prune_webhooks(10**10, 1) == 1  # finished deliveries past retention go; pending ones stay
    assert {r["state"] for r in deliveries(store)} == {"pending"}
