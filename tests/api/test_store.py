"""The SQLite job store: round trips, paging, recovery queries, durability across reopening."""

from __future__ import annotations

from pathlib import Path

import pytest

from h3serve.api.store import SQLiteJobStore, decode_request, encode_request
from h3serve.engine.jobs import Job, JobError, new_job_id
from h3serve.request import GenerationRequest, MediaRef


def make_job(created_at: int = 100, sync: bool = False, **request) -> Job:
    return Job(
        id=new_job_id(), model="tiny", request=GenerationRequest(prompt="p", **request), created_at=created_at,
        size="128x64", seconds="4", num_frames=107, fps=24, duration_s=107 / 24, sync=sync,
    )


@pytest.fixture
def store(tmp_path):
    s = SQLiteJobStore(tmp_path / "jobs.sqlite3")
    yield s
    s.close()


def test_request_codec_round_trips_media():
    refs = (MediaRef(Path("/d/a.png"), "a.png", "image"), MediaRef(Path("/d/b.mp4"), "https://x/b.mp4", None))
    request = GenerationRequest(prompt="p", width=128, height=64, duration_s=4.5, seed=3, task="ref2va",
                                image=None, references=refs)
    assert decode_request(encode_request(request)) == request


def test_insert_get_update_delete(store):
    job = store.insert(make_job(seed=9, image=MediaRef(Path("/d/k.png"), "k.png", "image")))
    assert job.seq == 1 and store.get(job.id) == job
    store.update(job.id, status="failed", progress=40, error=JobError("generation_failed", "boom"),
                 stage_durations={"denoise": 1.5}, completed_at=120, expired=True)
    got = store.get(job.id)
    assert (got.status, got.progress, got.error, got.stage_durations, got.completed_at, got.expired) == (
        "failed", 40, JobError("generation_failed", "boom"), {"denoise": 1.5}, 120, True
    )
    with pytest.raises(ValueError):
        store.update(job.id, id="video_other")
    assert store.delete(job.id) and not store.delete(job.id) and store.get(job.id) is None


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


def test_recovery_queries_and_durability(tmp_path):
    path = tmp_path / "jobs.sqlite3"
    store = SQLiteJobStore(path)
    a, b, c = (store.insert(make_job()) for _ in range(3))
    s = store.insert(make_job(sync=True))
    store.update(a.id, status="completed", progress=100, expires_at=150)
    store.update(b.id, status="in_progress", progress=50)
    store.close()

    reopened = SQLiteJobStore(path)
    assert [j.id for j in reopened.unfinished()] == [b.id, c.id, s.id]
    assert [j.id for j in reopened.sync_jobs()] == [s.id]
    assert reopened.due_to_expire(149) == [] and [j.id for j in reopened.due_to_expire(150)] == [a.id]
    assert reopened.ids() == {a.id, b.id, c.id, s.id}
    reopened.close()
