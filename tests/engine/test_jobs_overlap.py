"""Output overlap: a replica's next job runs while the previous one's MP4 is written; same files, same records."""

from __future__ import annotations

import hashlib
import threading
import time

import pytest
from fake_executor import FakeExecutor
from waiting import wait_until

from h3serve.engine.jobs import JobManager, outcomes
from h3serve.jobstore.job_files import JobFiles
from h3serve.jobstore.records import Job
from h3serve.jobstore.sqlite import SQLiteJobStore
from h3serve.media.mp4 import EncoderOptions
from h3serve.media.previews import VARIANTS
from h3serve.rules.request import GenerationRequest

FAST_ENCODE = EncoderOptions(preset="ultrafast", threads=1)


class HeldWrites:
    """Replaces `write_artifacts`: each write waits until released, so a test can look while it is pending."""

    def __init__(self, real):
        self.real = real
        self.release = threading.Event()
        self.started: list[str] = []  # job folder names, in the order their writes began

    def __call__(self, job_dir, output, options):
        self.started.append(job_dir.name)
        assert self.release.wait(30), "the test never released the write"
        return self.real(job_dir, output, options)


@pytest.fixture
def held(monkeypatch) -> HeldWrites:
    writes = HeldWrites(outcomes.write_artifacts)
    monkeypatch.setattr(outcomes, "write_artifacts", writes)
    return writes


@pytest.fixture
def make(tmp_path):
    made: list[tuple[JobManager, SQLiteJobStore]] = []

    def build(name: str, **kw) -> JobManager:
        store = SQLiteJobStore(tmp_path / f"{name}.sqlite3")
        manager = JobManager(FakeExecutor(), store, JobFiles(tmp_path / name), model_name="tiny",
                             encoder_options=FAST_ENCODE, **kw)
        made.append((manager, store))
        manager.start()
        return manager

    yield build
    for manager, store in made:
        manager.close(timeout_s=10)
        store.close()


def submit(manager: JobManager, seed: int) -> Job:
    request = GenerationRequest(prompt="waves", width=128, height=64, duration_s=4, steps=2, seed=seed)
    return manager.submit(request, seconds="4")


def status(manager: JobManager, job: Job) -> str | None:
    record = manager.store.get(job.id)
    return None if record is None else record.status


def test_the_next_job_runs_while_the_previous_output_is_written(make, held):
    manager = make("overlap")
    first, second = submit(manager, 1), submit(manager, 2)
    wait_until(lambda: len(manager.executor.plans) == 2, what="the second job's run")  # first still writing
    assert held.started == [first.id] and status(manager, first) == "in_progress"  # done once written
    held.release.set()
    for job in (first, second):
        wait_until(lambda job=job: status(manager, job) == "completed", what="completion")
        assert manager.files.file(job.id, VARIANTS["video"].file_name).is_file()
    assert manager.store.get(first.id).completions == 1 and manager.store.get(second.id).completions == 1


def test_without_overlap_the_next_job_waits_for_the_write(make, held):
    manager = make("serial", overlap_output=False)
    first, second = submit(manager, 1), submit(manager, 2)
    wait_until(lambda: held.started == [first.id], what="the first write")
    time.sleep(0.3)  # ample for the fake engine to start the second job, were it allowed to
    assert len(manager.executor.plans) == 1 and status(manager, second) == "queued"
    held.release.set()
    wait_until(lambda: status(manager, second) == "completed", what="the second job")


def test_overlapped_and_serial_outputs_are_byte_identical(make):
    digests = []
    for name, overlap in (("on", True), ("off", False)):
        manager = make(name, overlap_output=overlap)
        jobs = [submit(manager, seed) for seed in (1, 2, 3)]
        for job in jobs:
            wait_until(lambda job=job, m=manager: status(m, job) == "completed", what="completion")
        digests.append([
            hashlib.sha256(manager.files.file(job.id, name_).read_bytes()).hexdigest()
            for job in jobs for name_ in (VARIANTS["video"].file_name, VARIANTS["thumbnail"].file_name)
        ])
    assert digests[0] == digests[1]


def test_a_job_deleted_while_its_output_is_written_leaves_nothing(make, held):
    manager = make("delete")
    first, second = submit(manager, 1), submit(manager, 2)
    wait_until(lambda: held.started == [first.id], what="the first write")
    assert manager.delete(first.id)
    held.release.set()
    wait_until(lambda: status(manager, second) == "completed", what="the second job")
    wait_until(lambda: not manager.files.job_dir(first.id).exists(), what="the deleted job's files removed")
    assert manager.store.get(first.id) is None


def test_drain_waits_for_the_output_being_written(make, held):
    manager = make("drain")
    job = submit(manager, 1)
    wait_until(lambda: held.started == [job.id], what="the write")
    threading.Timer(0.3, held.release.set).start()
    assert manager.drain(grace_s=10)  # returns once the write is done and recorded
    assert status(manager, job) == "completed"
