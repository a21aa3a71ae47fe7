"""The job store contract, on SQLite and on a real PostgreSQL: round trips, paging, recovery queries,
durability across reopening, migrations, and the shared queue (claim, lease, expiry, exactly-once)."""

from __future__ import annotations

import dataclasses
import sqlite3
import threading
import time
from pathlib import Path

import psycopg
import pytest

from h3serve.jobstore import open_job_store
from h3serve.jobstore.codec import decode_request, encode_request
from h3serve.jobstore.migrations import LATEST
from h3serve.jobstore.postgres import PostgresJobStore
from h3serve.jobstore.records import Job, JobError, new_job_id
from h3serve.jobstore.store_errors import StoreClosed, StoreUnavailable
from h3serve.rules.request import GenerationRequest, MediaRef


def make_job(created_at: int = 100, sync: bool = False, **request) -> Job:
    return Job(
        id=new_job_id(), model="tiny", request=GenerationRequest(prompt="p", **request), created_at=created_at,
        size="128x64", seconds="4", num_frames=107, fps=24, duration_s=107 / 24, sync=sync,
    )


def test_request_codec_round_trips_media():
    refs = (MediaRef(Path("/d/a.png"), "a.png", "image"), MediaRef(Path("/d/b.mp4"), "https://x/b.mp4", None))
    request = GenerationRequest(prompt="p", width=128, height=64, duration_s=4.5, seed=3, task="ref2va",
                                image=None, references=refs)
    assert decode_request(encode_request(request)) == request


def test_insert_get_update_delete(store):
    job = store.insert(make_job(seed=9, image=MediaRef(Path("/d/k.png"), "k.png", "image")))
    assert job.seq == 1 and store.get(job.id) == job
    store.update(job.id, status="failed", progress=40, error=JobError("generation_failed", "boom"),
                 stage_durations={"denoise": 1.5}, completed_at=120, expired=True,
                 stage_timeline=(("denoise", 0.25, 1.75), ("mux", 1.5, 2.0)))
    got = store.get(job.id)
    assert got.stage_timeline == (("denoise", 0.25, 1.75), ("mux", 1.5, 2.0))
    assert (got.status, got.progress, got.error, got.stage_durations, got.completed_at, got.expired) == (
        "failed", 40, JobError("generation_failed", "boom"), {"denoise": 1.5}, 120, True
    )
    with pytest.raises(ValueError):
        store.update(job.id, id="video_other")
    assert store.delete(job.id) and not store.delete(job.id) and store.get(job.id) is None


def test_a_call_after_close_raises_store_closed_and_reopens_nothing(target):
    """A request the shutdown stopped waiting for may reach the store after it closed: a typed error the API
    answers 503, never a driver error, and no connection opened again that nobody would close."""
    store = open_job_store(target)
    job = store.insert(make_job())
    store.close()
    for call in (lambda: store.get(job.id), lambda: store.delete(job.id), store.count_queued):
        with pytest.raises(StoreClosed):
            call()
    if isinstance(store, PostgresJobStore):
        assert store._db.closed  # not connected again: nobody would close that connection
    store.close()  # idempotent


def test_paging_in_both_orders_skips_sync_jobs(store):
    jobs = [store.insert(make_job(created_at=100)) for _ in range(5)]
    store.insert(make_job(sync=True))
    ids = [j.id for j in jobs]
    page, more = store.page(None, 2, "desc")
    assert [j.id for j in page] == ids[::-1][:2] and more
    page, more = store.page(page[-1].id, 2, "desc")
    assert [j.id for j in page] == ids[::-1][2:4] and more
    page, more = store.page(page[-1].id, 2, "desc")
    assert [j.id for j in page] == [ids[0]] and not more
    page, more = store.page(ids[1], 10, "asc")
    assert [j.id for j in page] == ids[2:] and not more
    assert store.page("video_" + "0" * 32, 10, "asc") == ([], False)
    assert store.count_by_status() == {"queued": 5}


def test_recovery_queries_and_durability(target):
    store = open_job_store(target)
    a, b, c = (store.insert(make_job()) for _ in range(3))
    s = store.insert(make_job(sync=True))
    store.update(a.id, status="completed", progress=100, expires_at=150)
    store.update(b.id, status="in_progress", progress=50)
    store.close()

    reopened = open_job_store(target)
    assert [j.id for j in reopened.unfinished()] == [b.id, c.id, s.id]
    assert [j.id for j in reopened.sync_jobs()] == [s.id]
    assert reopened.due_to_expire(149) == [] and [j.id for j in reopened.due_to_expire(150)] == [a.id]
    assert reopened.ids() == {a.id, b.id, c.id, s.id}
    reopened.close()


def test_migrations_are_versioned_and_a_newer_schema_is_refused(target, tmp_path):
    open_job_store(target).close()
    store = open_job_store(target)  # a second start applies nothing
    assert [dict(r) for r in store._run("SELECT version FROM schema_version")] == [{"version": LATEST}]
    store._run("UPDATE schema_version SET version = 99")
    store.close()
    with pytest.raises(RuntimeError, match="newer than this h3serve"):
        open_job_store(target)


def test_a_version_1_sqlite_store_is_migrated_in_place(tmp_path):
    path = tmp_path / "jobs.sqlite3"
    from h3serve.jobstore.migrations import _migrations

    with sqlite3.connect(path) as db:  # as h3serve 0.1 left it: schema 1, recorded as PRAGMA user_version
        for statement in _migrations("sqlite")[0]:
            db.execute(statement)
        db.execute("PRAGMA user_version=1")
    store = open_job_store(path)
    job = store.insert(make_job())
    assert store.claim("a", 30).id == job.id and store.get(job.id).completions == 0
    store.close()


def _version_2_store(target, jobs: list[Job]) -> None:
    """A store as h3serve left it before the step-count change (schema 2), holding `jobs` as it wrote them."""
    from h3serve.jobstore.codec import COLUMNS, to_sql
    from h3serve.jobstore.migrations import _migrations

    sqlite = isinstance(target, Path)
    db = sqlite3.connect(target, isolation_level=None) if sqlite else psycopg.connect(target, autocommit=True)
    mark = "?" if sqlite else "%s"
    for statements in _migrations("sqlite" if sqlite else "postgresql")[:2]:
        for statement in statements:
            db.execute(statement)
    db.execute("CREATE TABLE schema_version (version INTEGER NOT NULL)")
    db.execute("INSERT INTO schema_version (version) VALUES (2)")
    if sqlite:
        db.execute("PRAGMA user_version=2")
    # Schemas 4-7 added these.
    columns = [name for name in COLUMNS if name not in ("progress_steps", "num_outputs", "key_scope", "stage_timeline")]
    for job in jobs:
        values = [to_sql(name, getattr(job, name)) for name in columns]
        db.execute(f"INSERT INTO jobs ({', '.join(columns)}) VALUES ({', '.join([mark] * len(columns))})", values)
    db.close()


def test_requests_stored_before_steps_counted_forwards_keep_their_forward_count(target):
    """Schema 2 stored `steps` as sigma points (M points: M - 1 forwards); schema 3 counts forwards, so the upgrade
    rewrites each stored count once: a job queued before the upgrade runs the forwards it was submitted for."""
    done = dataclasses.replace(make_job(steps=50, seed=4, duration_s=5.0), status="completed", progress=100)
    old = {"queued": make_job(steps=8), "default": make_job(), "least": make_job(steps=1), "done": done}
    _version_2_store(target, list(old.values()))
    store = open_job_store(target)
    steps = {name: store.get(job.id).request.steps for name, job in old.items()}
    assert steps == {"queued": 7, "default": None, "least": 1, "done": 49}
    assert {store.get(job.id).progress_steps for job in old.values()} == {0}  # schema 4: not recorded then
    assert {store.get(job.id).num_outputs for job in old.values()} == {1}  # schema 5: one output each then
    assert {store.get(job.id).stage_timeline for job in old.values()} == {()}  # schema 6: not recorded then
    assert store.get(old["done"].id).request == GenerationRequest(prompt="p", steps=49, seed=4, duration_s=5.0)
    new = store.insert(dataclasses.replace(make_job(steps=8), progress_steps=24))
    store.close()
    reopened = open_job_store(target)  # the migration ran once: neither old nor new counts move again
    assert reopened.get(old["queued"].id).request.steps == 7 and reopened.get(new.id).request.steps == 8
    assert reopened.get(new.id).progress_steps == 24
    assert reopened.claim("s1", 30).id == old["queued"].id
    reopened.close()


def test_claim_takes_the_oldest_and_finish_records_once(store):
    a, b = store.insert(make_job()), store.insert(make_job())
    claimed = store.claim("s1", 30)
    assert claimed.id == a.id and (claimed.status, claimed.owner) == ("in_progress", "s1")
    assert claimed.lease_expires_at > time.time() + 25
    assert store.claim("s2", 30).id == b.id and store.claim("s3", 30) is None
    assert not store.update_owned(a.id, "s2", progress=50) and store.update_owned(a.id, "s1", progress=50)
    assert not store.finish(a.id, "s2", status="completed")  # not its job
    assert store.finish(a.id, "s1", status="completed", progress=100)
    assert not store.finish(a.id, "s1", status="completed")  # recorded already
    done = store.get(a.id)
    assert (done.status, done.progress, done.completions) == ("completed", 100, 1)
    assert store.count_queued() == 0 and store.renew("s1", 30, {a.id}) == set()
    assert store.renew("s2", 30, {a.id, b.id}) == {b.id} and store.renew("s2", 30, ()) == set()


def test_the_queue_counts_outputs(store):
    """A job of N outputs counts N toward --max-queue (both stores)."""
    assert store.count_queued() == 0
    store.insert(dataclasses.replace(make_job(), num_outputs=3))
    one = store.insert(make_job())
    assert store.count_queued() == 4 and store.get(one.id).num_outputs == 1
    store.claim("s1", 30)
    assert store.count_queued() == 1


def test_an_expired_lease_is_reclaimed_and_the_old_owner_cannot_record(store):
    job = store.insert(make_job())
    assert store.claim("dead", 0.2).id == job.id
    assert store.claim("live", 30) is None  # the lease still holds
    time.sleep(0.3)
    assert store.claim("live", 30).id == job.id
    assert store.renew("dead", 30, {job.id}) == set() and not store.finish(job.id, "dead", status="completed")
    assert store.finish(job.id, "live", status="completed") and store.get(job.id).completions == 1


def test_sync_jobs_are_claimed_by_their_server_only_and_reaped_when_it_is_gone(store):
    mine = store.insert(make_job(sync=True))
    store.update(mine.id, owner="s1", lease_expires_at=time.time() + 30)
    orphan = store.insert(make_job(sync=True))
    store.update(orphan.id, owner="gone", lease_expires_at=time.time() - 1)
    assert store.claim("s2", 30) is None
    assert store.reap_orphaned_sync() == [orphan.id] and store.get(orphan.id) is None
    assert store.claim("s1", 30).id == mine.id
    assert store.release(mine.id, "s1") and store.get(mine.id).status == "queued"
    assert store.reap_orphaned_sync() == [mine.id]  # released: nobody waits for it any more


def test_concurrent_claims_never_share_a_job(target):
    first = open_job_store(target)
    ids = {first.insert(make_job()).id for _ in range(30)}
    stores = [open_job_store(target) for _ in range(3)]  # separate connections, as separate servers
    claimed: list[list[str]] = [[] for _ in stores]

    def drain(i: int) -> None:
        while (job := stores[i].claim(f"s{i}", 30)) is not None:
            claimed[i].append(job.id)
            assert stores[i].finish(job.id, f"s{i}", status="completed")

    threads = [threading.Thread(target=drain, args=(i,)) for i in range(len(stores))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    everything = [j for c in claimed for j in c]
    assert sorted(everything) == sorted(ids)
    assert {first.get(j).completions for j in ids} == {1}
    for s in (first, *stores):
        s.close()


def test_a_dropped_postgresql_connection_is_reopened_on_the_next_call(postgres_url):
    store = open_job_store(postgres_url)
    job = store.insert(make_job())
    backend = store._run("SELECT pg_backend_pid() AS pid")[0]["pid"]
    with psycopg.connect(postgres_url, autocommit=True) as admin:  # as a database restart would
        admin.execute("SELECT pg_terminate_backend(%s)", (backend,))
    with pytest.raises(StoreUnavailable, match="the job database is unreachable"):
        store.get(job.id)
    assert store.get(job.id) == job  # the next call reconnects
    store.close()
