"""Real-time sessions on the job manager's replicas: a session takes a replica that runs nothing, the replica's runner
claims no job while it is held, the queue runs on the other replicas, and releasing it lets the jobs through."""

from __future__ import annotations

import threading
import time

import pytest
from fake_executor import FakeExecutor
from waiting import wait_until

from h3serve.engine.jobs import JobManager
from h3serve.engine.jobs.types import ShuttingDown
from h3serve.engine.realtime_stream import RealtimeBusy
from h3serve.jobstore.job_files import JobFiles
from h3serve.jobstore.sqlite import SQLiteJobStore
from h3serve.media.mp4 import EncoderOptions
from h3serve.rules.request import GenerationRequest


@pytest.fixture
def make(tmp_path):
    store = SQLiteJobStore(tmp_path / "jobs.sqlite3")
    managers = []

    def build(replicas: int, step_s: float = 0.01) -> JobManager:
        executors = [FakeExecutor(step_s=step_s) for _ in range(replicas)]
        manager = JobManager(executors, store, JobFiles(tmp_path / "jobs"), model_name="tiny", poll_s=0.05,
                             encoder_options=EncoderOptions(preset="ultrafast"))
        manager.start()
        managers.append(manager)
        return manager

    yield build
    for manager in managers:
        manager.close(timeout_s=10)
    store.close()


def submit(manager: JobManager, steps: int = 2):
    request = GenerationRequest(prompt="waves", width=128, height=64, duration_s=4, steps=steps, seed=1)
    return manager.submit(request, seconds="4")


def status(manager: JobManager, job_id: str) -> str:
    return manager.store.get(job_id).status


def test_a_held_replica_runs_no_job_until_released(make):
    manager = make(1)
    lease = manager.sessions.reserve()
    assert manager.replicas()[0].busy
    with pytest.raises(RealtimeBusy) as busy:
        manager.sessions.reserve()  # one session per replica
    assert busy.value.retry_after_s >= 1
    job = submit(manager)
    time.sleep(0.5)  # ten of the runner's polls
    assert status(manager, job.id) == "queued"
    lease.release()
    lease.release()  # idempotent: the replica is not released twice
    wait_until(lambda: status(manager, job.id) == "completed", timeout_s=10)
    assert not manager.replicas()[0].busy


def test_a_session_takes_the_replica_that_runs_no_job(make):
    manager = make(2, step_s=0.05)
    running = submit(manager, steps=40)  # about 2 s on one replica
    wait_until(lambda: status(manager, running.id) == "in_progress", timeout_s=10)
    held = [r.index for r in manager.replicas() if r.busy]
    lease = manager.sessions.reserve()
    assert lease.replica not in held
    with pytest.raises(RealtimeBusy):
        manager.sessions.reserve()  # one replica runs the job, the other the session
    queued = submit(manager)
    wait_until(lambda: status(manager, queued.id) == "completed", timeout_s=20)  # after the job, on its replica
    lease.release()


def test_reserving_is_atomic_with_claiming(make):
    manager = make(1)
    leases, refused = [], []

    def take():
        try:
            leases.append(manager.sessions.reserve())
        except RealtimeBusy:
            refused.append(True)

    threads = [threading.Thread(target=take) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(leases) == 1 and len(refused) == 7


def test_no_session_once_the_manager_stops(make):
    manager = make(1)
    manager.stop()
    with pytest.raises(ShuttingDown):
        manager.sessions.reserve()
