"""Data-parallel replicas on CPU with real rank processes: jobs run side by side, each replica's output is
byte-identical to a single engine's for the same seed, and a rank killed in one replica fails only its job."""

from __future__ import annotations

import os
import signal

import pytest
import torch
from waiting import wait_until

from h3serve.config.engine_config import EngineConfig
from h3serve.engine.jobs import JobManager
from h3serve.engine.replicas import start_replicas
from h3serve.jobstore.job_files import JobFiles
from h3serve.jobstore.records import Job
from h3serve.jobstore.sqlite import SQLiteJobStore
from h3serve.media.mp4 import EncoderOptions
from h3serve.parallel.rendezvous import Rendezvous
from h3serve.rank.model_runner import ModelRunner
from h3serve.rules.request import GenerationRequest
from h3serve.rules.validate import validate

pytestmark = pytest.mark.slow


def _request(seed: int, steps: int = 1) -> GenerationRequest:
    return GenerationRequest(prompt="waves on a beach", width=128, height=64, duration_s=4, steps=steps, seed=seed)


@pytest.fixture(scope="module")
def replicas(tiny_checkpoint):
    executors = start_replicas(EngineConfig(model=tiny_checkpoint, threads=1, data_parallel_size=2),
                               Rendezvous.local())
    yield executors
    for executor in executors:
        executor.close()


def test_replicas_match_a_single_engine_byte_for_byte(replicas, tiny_checkpoint):
    plan = validate(_request(seed=5), replicas[0].defaults)
    threads = torch.get_num_threads()
    try:  # the single engine in-process, at the replicas' thread count (CPU reductions depend on it)
        reference = ModelRunner(EngineConfig(model=tiny_checkpoint, threads=1)).generate(plan)
    finally:
        torch.set_num_threads(threads)
    for executor in replicas:
        out = executor.generate(plan)
        assert out.video.tobytes() == reference.video.tobytes() and out.audio.tobytes() == reference.audio.tobytes()


def test_a_rank_killed_in_one_replica_fails_only_its_job(replicas, tmp_path):
    store = SQLiteJobStore(tmp_path / "jobs.sqlite3")
    manager = JobManager(replicas, store, JobFiles(tmp_path / "jobs"), model_name="tiny",
                         encoder_options=EncoderOptions("ultrafast"),
                         poll_s=0.05)
    manager.start()
    try:
        def submit(seed: int, steps: int) -> Job:
            request = _request(seed, steps)
            return manager.submit(request, seconds="4")

        doomed = submit(1, 200)
        status = wait_until(lambda: next((r for r in manager.replicas() if r.job_id == doomed.id), None),
                            what="the long job on a replica")
        wait_until(lambda: store.get(doomed.id).progress > 0, timeout_s=60, what="the long job denoising")
        survivor = submit(2, 3)
        wait_until(lambda: any(r.busy and r.job_id == survivor.id for r in manager.replicas()), timeout_s=30,
                   what="the other replica taking the second job")
        os.kill(replicas[status.index].pids()[0], signal.SIGKILL)
        failed = wait_until(lambda: (j := store.get(doomed.id)).status == "failed" and j, timeout_s=60, what="fail")
        assert failed.error.code == "generation_failed" and "exited with code -9" in failed.error.message
        done = wait_until(lambda: (j := store.get(survivor.id)).status in ("completed", "failed") and j,
                          timeout_s=60, what="the other job")
        assert done.status == "completed" and done.completions == 1
        again = submit(3, 2)  # the killed replica restarted: every replica serves again
        assert wait_until(lambda: (j := store.get(again.id)).status == "completed" and j, timeout_s=90, what="rerun")
        assert all(executor.alive() for executor in replicas) and replicas[status.index].restarts == 1
    finally:
        manager.close(timeout_s=30)
        store.close()
