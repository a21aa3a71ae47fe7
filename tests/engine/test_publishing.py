"""Publishing outputs to a bucket (the session's Ceph gateway, behind a TCP proxy that can fail or stall it), on the
fake engine: the bucket down mid-job (retries with backoff, then a failed job with a reason), slow storage holding
neither the ranks nor the submissions, a server stopped mid-upload (the next start publishes the staged files
without running the job again, and no half object is ever there), and a shared queue without a shared disk (a job's
inputs travel through the bucket to the server that claims it)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from fake_executor import FakeExecutor
from PIL import Image
from tcp_proxy import TcpProxy
from waiting import wait_until

from h3serve.engine.jobs import JobManager
from h3serve.engine.jobs.staging import Staged
from h3serve.jobstore import open_job_store
from h3serve.jobstore.job_files import JobFiles
from h3serve.jobstore.records import Job, new_job_id
from h3serve.media.mp4 import EncoderOptions
from h3serve.output_store.location import BucketLocation
from h3serve.output_store.s3_bucket import S3BucketStore
from h3serve.rules.request import GenerationRequest, MediaRef

FAST_ENCODE = EncoderOptions(preset="ultrafast", threads=1)
PREFIX = "jobs"


def request(seed: int, **kw) -> GenerationRequest:
    return GenerationRequest(prompt="waves", width=128, height=64, duration_s=4, steps=2, seed=seed, **kw)


@pytest.fixture
def proxy(ceph_gateway):
    proxy = TcpProxy(ceph_gateway.endpoint_url)
    yield proxy
    proxy.close()


@pytest.fixture
def make(tmp_path, bucket, aws_env, proxy):
    """`make(name, store=None, start=True)`: a manager on the fake engine whose outputs go to the test's bucket
    through the proxy; its data dir is `tmp_path/name`; a SQLite store there unless one is given."""
    made: list[tuple[JobManager, object]] = []

    def build(name: str, store=None, start: bool = True, **kw) -> JobManager:
        own = store is None
        store = store or open_job_store(tmp_path / f"{name}.sqlite3")
        files = JobFiles(tmp_path / name)
        outputs = S3BucketStore(BucketLocation(bucket, PREFIX), proxy.url)
        manager = JobManager(FakeExecutor(), store, files, model_name="tiny", encoder_options=FAST_ENCODE,
                             outputs=outputs, **{"upload_attempts": 2, "upload_backoff_s": 0.05, **kw})
        made.append((manager, store if own else None))
        if start:
            manager.start()
        return manager

    yield build
    for manager, store in made:
        manager.close(timeout_s=10)
        if store is not None:
            store.close()


def finished(manager: JobManager, job: Job, timeout_s: float = 30) -> Job:
    return wait_until(lambda: (j := manager.store.get(job.id)) is not None and j.status in ("completed", "failed")
                      and j, timeout_s, f"{job.id} to finish", 0.02)


def keys(ceph_gateway, bucket: str, job_id: str) -> list[str]:
    listed = ceph_gateway.client().list_objects_v2(Bucket=bucket, Prefix=f"{PREFIX}/{job_id}/")
    return sorted(item["Key"].split("/")[-1] for item in listed.get("Contents", []))


def test_the_bucket_down_mid_job_fails_it_with_the_reason_after_retries(make, proxy, ceph_gateway, bucket):
    manager = make("down")
    seen: list[str] = []
    manager.add_upload_listener(lambda outcome, size, seconds: seen.append(outcome))
    proxy.set_down()
    job = finished(manager, manager.submit(request(1), seconds="4"))
    assert job.status == "failed" and job.error.code == "output_store_unavailable"
    assert job.error.message.startswith("storing the video files in the output store failed after 2 attempt(s): ")
    assert "cannot reach the S3 endpoint" in job.error.message and proxy.url not in job.error.message
    assert seen == ["retried", "failed"]
    assert not any(manager.files.job_dir(job.id).glob("*.mp4"))  # nothing staged is left behind
    proxy.set_down(False)
    job = finished(manager, manager.submit(request(2), seconds="4"))
    assert job.status == "completed" and keys(ceph_gateway, bucket, job.id) == [
        "spritesheet.jpg", "thumbnail.webp", "video.mp4"]
    assert seen[2:] == ["uploaded"] * 3


def test_slow_storage_holds_neither_the_ranks_nor_the_submissions(make, proxy):
    manager = make("slow")
    proxy.hold()  # every request to the bucket stalls until released
    first, second = manager.submit(request(3), seconds="4"), manager.submit(request(4), seconds="4")
    wait_until(lambda: len(manager.executor.plans) == 2, what="the second job run while the first uploads")
    wait_until(lambda: len(manager.book.uploads()) == 2, what="both jobs uploading")
    third = manager.submit(request(5), seconds="4")  # the lock is free: uploads never hold it
    wait_until(lambda: len(manager.executor.plans) == 3, what="the third job run")
    manager.heartbeat()  # uploading jobs are still held: their leases renew
    assert {manager.store.get(j.id).status for j in (first, second, third)} == {"in_progress"}
    assert {manager.store.get(j.id).owner for j in (first, second)} == {manager.owner}
    proxy.release()
    assert [finished(manager, j).status for j in (first, second, third)] == ["completed"] * 3


def test_a_server_stopped_mid_upload_publishes_the_staged_files_on_its_next_start(make, proxy, ceph_gateway, bucket,
                                                                                 tmp_path):
    store = open_job_store(tmp_path / "jobs.sqlite3")
    try:
        first = make("data", store=store)
        proxy.hold()
        job = first.submit(request(6), seconds="4")
        wait_until(lambda: proxy.saw(f"/{job.id}/"), what="its upload under way")
        first.stop()
        proxy.set_down()  # the held upload breaks; stopping, the job goes back to the queue
        wait_until(lambda: store.get(job.id).status == "queued", what="the job back in the queue")
        assert first.join(10)
        assert "video.mp4" not in keys(ceph_gateway, bucket, job.id)  # never a half object
        staged = first.files.job_dir(job.id) / "video.mp4"
        staged_bytes = staged.read_bytes()

        proxy.set_down(False)
        proxy.release()
        second = make("data", store=store)  # the same data dir and store: a restart
        done = finished(second, job)
        assert done.status == "completed" and done.completions == 1
        assert second.executor.plans == []  # published from the staged files, not run again
        assert ceph_gateway.client().get_object(Bucket=bucket, Key=f"{PREFIX}/{job.id}/video.mp4")[
            "Body"].read() == staged_bytes
        assert not staged.exists()
    finally:
        store.close()


def test_a_shared_queue_without_a_shared_disk_moves_the_inputs_through_the_bucket(make, postgres_url, ceph_gateway,
                                                                                 bucket):
    store = open_job_store(postgres_url)
    try:
        submitter = make("submitter", store=store, start=False)  # takes the request, runs nothing
        runner = make("runner", store=store)  # another host: its own data dir
        job_id = new_job_id()
        keyframe = submitter.files.inputs_dir(job_id) / "00-keyframe.png"
        Image.fromarray(np.full((256, 512, 3), 90, np.uint8)).save(keyframe)
        job = submitter.submit(request(7, image=MediaRef(keyframe, "keyframe.png", "image")), job_id=job_id,
                               seconds="4")
        assert keys(ceph_gateway, bucket, job_id + "/inputs") == ["00-keyframe.png"]
        assert finished(runner, job).status == "completed"
        (plan,) = runner.executor.plans
        assert Path(plan.image.path) == runner.files.job_dir(job_id) / "inputs" / "00-keyframe.png"
        assert Path(plan.image.path).read_bytes() == keyframe.read_bytes()
        assert runner.delete(job_id) and keys(ceph_gateway, bucket, job_id) == []
    finally:
        store.close()


def test_a_restart_drops_what_it_staged_for_jobs_finished_elsewhere(make, tmp_path):
    """A server killed mid-upload, whose job another server then reran and published, finds its staged copies
    at its next start: they go (the inputs stay with the job); a job still unfinished keeps them to publish."""
    store = open_job_store(tmp_path / "jobs.sqlite3")
    try:
        idle = make("restarted", store=store, start=False)
        done, waiting = (idle.submit(request(seed), seconds="4") for seed in (8, 9))
        for job in (done, waiting):
            folder = idle.files.job_dir(job.id)
            folder.mkdir()
            (folder / "video.mp4").write_bytes(b"staged")
            Staged({"video.mp4": "video/mp4"}, {"progress": 100}).save(folder)
        store.update(done.id, status="completed")
        assert idle.publisher.drop_stale_staging() == 1
        assert idle.publisher.staged(done.id) is None and not (idle.files.job_dir(done.id) / "video.mp4").exists()
        assert idle.publisher.staged(waiting.id) is not None
    finally:
        store.close()
