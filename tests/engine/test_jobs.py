"""The job manager: FIFO order, progress, files, queue bound, cancellation, failures, recovery, expiry."""

from __future__ import annotations

import math
import threading
from dataclasses import replace

import pytest
from fake_executor import CLIENT_FAIL_PROMPT, CRASH_PROMPT, FAIL_PROMPT, TIMEOUT_PROMPT, FakeExecutor
from PIL import Image
from waiting import wait_until

from h3serve.api.prometheus import Metrics
from h3serve.engine.admission import TooCostly
from h3serve.engine.jobs import JobManager
from h3serve.engine.jobs.types import QueueFull, ShuttingDown
from h3serve.errors import INTERNAL_ERROR_MESSAGE
from h3serve.jobstore.job_files import JobFiles
from h3serve.jobstore.records import Job, new_job_id
from h3serve.jobstore.sqlite import SQLiteJobStore
from h3serve.media.media_errors import MediaDecodeError
from h3serve.media.mp4 import EncoderOptions
from h3serve.media.previews import SPRITE_COLUMNS, SPRITE_ROWS, VARIANTS
from h3serve.rules.request import GenerationRequest
from h3serve.rules.validate import RequestError

FAST_ENCODE = EncoderOptions(preset="ultrafast")


class Clock:
    def __init__(self, now: float = 1_000_000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def env(tmp_path):
    """Builds managers over one data dir (a restart is a second manager on the same store and files)."""
    store = SQLiteJobStore(tmp_path / "jobs.sqlite3")
    files = JobFiles(tmp_path / "jobs")
    managers = []

    def make(executor=None, **kw) -> JobManager:
        kw.setdefault("encoder_options", FAST_ENCODE)
        kw.setdefault("max_request_cost", math.inf)  # the manager's own behaviour, not admission (tests/api)
        manager = JobManager(executor or FakeExecutor(), store, files, model_name="tiny", **kw)
        managers.append(manager)
        return manager

    yield make, store, files
    for m in managers:
        m.close(timeout_s=10)
    store.close()


def submit(manager: JobManager, seed: int = 1, steps: int = 2, prompt: str = "waves", **kw) -> Job:
    request = GenerationRequest(prompt=prompt, width=128, height=64, duration_s=4, steps=steps, seed=seed)
    return manager.submit(request, seconds="4", **kw)


def finished(store, job_id):
    job = store.get(job_id)
    return job if job is not None and job.status in ("completed", "failed") else None


def test_jobs_run_in_order_and_leave_their_files(env):
    make, store, files = env
    manager = make(output_ttl_s=3600)
    seen = []
    manager.add_listener(lambda job: seen.append(job.id))
    manager.start()
    jobs = [submit(manager, seed=s) for s in (1, 2, 3)]
    done = [wait_until(lambda j=j: finished(store, j.id), what="completion") for j in jobs]

    assert [p.seed for p in manager.executor.plans] == [1, 2, 3]
    # Listeners run after the store is updated, so the last one may still be on its way.
    wait_until(lambda: len(seen) == 3, what="listeners")
    assert seen == [j.id for j in jobs]
    for job in done:
        assert (job.status, job.progress, job.num_frames, job.fps, job.error) == ("completed", 100, 107, 24, None)
        assert job.expires_at == job.completed_at + 3600 and job.inference_time_s > 0
        assert {"denoise", "encode"} <= set(job.stage_durations) and job.peak_memory_mb == 12.5
        # The engine's spans and the parent's encode on the job's own run clock, in order, each a real span.
        assert [name for name, _, _ in job.stage_timeline] == ["denoise", "encode"]
        (_, start, end), (_, encode_start, encode_end) = job.stage_timeline
        assert 0 <= start <= end <= encode_start <= encode_end <= job.inference_time_s + 1e-5  # spans: 6 decimals
        for variant in VARIANTS.values():
            assert files.file(job.id, variant.file_name).stat().st_size > 0
        with Image.open(files.file(job.id, VARIANTS["thumbnail"].file_name)) as thumb:
            assert (thumb.format, thumb.size) == ("WEBP", (128, 64))
        with Image.open(files.file(job.id, VARIANTS["spritesheet"].file_name)) as sheet:
            assert (sheet.format, sheet.size) == ("JPEG", (128 * SPRITE_COLUMNS, 64 * SPRITE_ROWS))


def test_progress_is_stored_at_every_step_and_status_follows_the_executor(env):
    make, store, _ = env
    manager = make()
    updates = []
    claim, update_owned, finish = store.claim, store.update_owned, store.finish

    def recording_claim(owner, lease_s):
        job = claim(owner, lease_s)
        if job is not None:
            updates.append({"status": job.status})
        return job

    def recording_update(job_id, owner, **changes):
        updates.append(changes)
        return update_owned(job_id, owner, **changes)

    def recording_finish(job_id, owner, **changes):
        updates.append(changes)
        return finish(job_id, owner, **changes)

    store.claim, store.update_owned, store.finish = recording_claim, recording_update, recording_finish
    manager.start()
    job = submit(manager, steps=4)  # 4 forwards
    wait_until(lambda: finished(store, job.id))
    progress = [u["progress"] for u in updates if "progress" in u]
    assert updates[0] == {"status": "in_progress"}
    assert progress == [25, 50, 75, 99, 100]
    assert store.get(job.id).completions == 1


def test_submit_plans_admits_and_records_the_request(env):
    """The manager, not its caller, plans the request, admits its cost and builds the job record."""
    make, store, _ = env
    manager = make(max_request_cost=None)  # the checkpoint's default limit
    job = manager.submit(GenerationRequest(prompt="waves", width=128, height=64, num_frames=100, seed=3))
    assert (job.model, job.size, job.num_frames, job.status) == ("tiny", "128x64", 107, "queued")
    assert job.seconds == f"{107 / 24:g}" and store.get(job.id) is not None  # no label given: the plan's duration
    assert manager.submit(GenerationRequest(prompt="waves", width=128, height=64), seconds="5").seconds == "5"
    with pytest.raises(RequestError) as e:
        manager.submit(GenerationRequest(prompt="waves", width=128, height=64, steps=0))
    assert e.value.field == "steps"
    with pytest.raises(TooCostly, match="over this server's limit"):
        manager.submit(GenerationRequest(prompt="waves", width=128, height=64, duration_s=15, steps=200))
    assert store.count_queued() == 2  # what was refused left no record


def test_queue_is_bounded(env):
    make, store, _ = env
    manager = make(FakeExecutor(step_s=0.2), max_queue=2)
    manager.start()
    running = submit(manager, steps=20)
    wait_until(lambda: store.get(running.id).status == "in_progress")
    submit(manager)
    submit(manager)
    with pytest.raises(QueueFull) as e:
        submit(manager)
    assert e.value.depth == 2 and e.value.retry_after_s >= 1
    with pytest.raises(QueueFull):
        manager.check_capacity()
    assert manager.queue_depth == 2 and len(store.ids()) == 3  # the refused job was never stored


def test_delete_cancels_queued_and_running_jobs(env):
    make, store, files = env
    executor = FakeExecutor(step_s=0.05)
    manager = make(executor)
    manager.start()
    running = submit(manager, seed=1, steps=200)
    queued = submit(manager, seed=2)
    wait_until(lambda: store.get(running.id).progress >= 1, what="first step")
    files.inputs_dir(queued.id)  # both jobs have folders to remove
    files.inputs_dir(running.id)

    assert manager.delete(queued.id)
    assert store.get(queued.id) is None and not files.job_dir(queued.id).exists()
    event = manager.done_event(running.id)
    assert manager.delete(running.id)
    assert store.get(running.id) is None
    assert event.wait(5), "the running job did not stop"
    step, total = executor.cancelled_at[0]
    assert total == 200 and step < 20  # stopped at the next step, not at the end
    assert not files.job_dir(running.id).exists()
    assert [p.seed for p in executor.plans] == [1]  # the deleted queued job never started
    later = submit(manager, seed=3)
    assert wait_until(lambda: finished(store, later.id)).status == "completed"
    assert not manager.delete(queued.id)


def test_a_failed_job_is_recorded_and_the_next_one_runs(env):
    make, store, _ = env
    manager = make(output_ttl_s=60)
    manager.start()
    bad, good = submit(manager, prompt=FAIL_PROMPT), submit(manager)
    failed = wait_until(lambda: finished(store, bad.id))
    assert failed.status == "failed" and failed.error.code == "generation_failed"
    assert "asked to fail" in failed.error.message and failed.expires_at == failed.completed_at + 60
    assert wait_until(lambda: finished(store, good.id)).status == "completed"


@pytest.mark.parametrize("prompt", [TIMEOUT_PROMPT, CRASH_PROMPT])
def test_an_unexpected_exception_fails_the_job_and_releases_its_waiter(env, prompt):
    make, store, _ = env
    manager = make()
    manager.start()
    bad = submit(manager, prompt=prompt, sync=True)
    waiter = manager.done_event(bad.id)
    good = submit(manager)
    assert waiter.wait(10), "the sync waiter was never released"
    failed = store.get(bad.id)  # stored before the waiter wakes, so it is final here
    assert (failed.status, failed.error.code, failed.error.message) == ("failed", "internal_error",
                                                                      INTERNAL_ERROR_MESSAGE)
    assert not failed.error.client_error and failed.completed_at is not None and failed.inference_time_s > 0
    assert wait_until(lambda: finished(store, good.id)).status == "completed"  # the runner survived
    assert manager.healthy()


def test_a_request_the_engine_rejects_is_a_client_error(env):
    make, store, _ = env
    manager = make()
    manager.start()
    rejected, broken = submit(manager, prompt=CLIENT_FAIL_PROMPT), submit(manager, prompt=FAIL_PROMPT)
    job = wait_until(lambda: finished(store, rejected.id))
    assert (job.status, job.error.code, job.error.client_error) == ("failed", "invalid_request", True)
    assert "not a recognised image" in job.error.message
    assert not wait_until(lambda: finished(store, broken.id)).error.client_error


class PathLeakingExecutor(FakeExecutor):
    """A rank whose media error quotes the job's input file by its absolute path (as FFmpeg's messages did)."""

    def __init__(self, files: JobFiles):
        super().__init__(step_s=0.001)
        self.files = files

    def generate(self, plan, on_progress=None, on_start=None, timeout_s=None, encoder=None):
        job_dir = next(path for path in self.files.root.iterdir() if path.is_dir())
        raise MediaDecodeError("clip.mp4", "control_reference",
                               f"cannot decode {job_dir / 'inputs' / '00-clip.mp4'} in {self.files.root}", "a file")


def test_a_job_error_names_files_relative_to_the_job(env):
    """Issue 54: job errors showed absolute server paths (.../jobs/<id>/inputs/00-x.mp4)."""
    make, store, files = env
    manager = make(PathLeakingExecutor(files))
    job = submit(manager)
    files.inputs_dir(job.id)  # where the job's uploads are stored
    manager.start()
    error = wait_until(lambda: finished(store, job.id)).error
    assert (error.code, error.client_error) == ("invalid_media", True)
    assert "cannot decode inputs/00-clip.mp4 in the jobs folder" in error.message, error.message
    assert str(files.root) not in error.message


def test_failed_jobs_reach_the_duration_histogram(env):
    make, store, _ = env
    manager = make()
    metrics = Metrics()
    manager.add_listener(metrics.on_job_finished)
    manager.start()
    submitted = submit(manager, prompt=FAIL_PROMPT)
    job = wait_until(lambda: finished(store, submitted.id))
    assert job.status == "failed" and job.inference_time_s > 0
    def failed_count() -> float | None:
        return metrics.registry.get_sample_value("h3serve_job_duration_seconds_count", {"status": "failed"})

    wait_until(failed_count, what="the listener")
    assert failed_count() == 1


def test_a_job_the_shutdown_kills_is_queued_again_not_failed(env):
    make, store, _ = env
    executor = FakeExecutor(step_s=0.02, ignore_cancel=True)  # a step longer than close() waits for
    first = make(executor)
    first.start()
    job = submit(first, steps=200)
    wait_until(lambda: store.get(job.id).progress >= 1)
    first.close(timeout_s=0.1)  # gives up: the job is still running
    assert store.get(job.id).status == "in_progress"
    executor.close()  # kills the ranks under it: EngineError
    assert first.join(10)
    assert (store.get(job.id).status, store.get(job.id).progress, store.get(job.id).error) == ("queued", 0, None)
    second = make(FakeExecutor(step_s=0.001))
    second.start()
    assert wait_until(lambda: finished(store, job.id)).status == "completed"


def test_restart_fails_a_job_whose_task_is_no_longer_served(env):
    make, store, _ = env
    job = submit(make())  # t2va, stored by a manager that never ran it
    manager = make(FakeExecutor(tasks=("ref2va",)))
    manager.start()
    failed = store.get(job.id)
    assert (failed.status, failed.error.code) == ("failed", "invalid_request")
    assert "t2va is not served here" in failed.error.message and manager.queue_depth == 0


def test_restart_requeues_unfinished_jobs_in_order_and_drops_the_rest(env):
    make, store, files = env
    first = make()  # never started: it only writes the state a crashed process would leave
    jobs = [submit(first, seed=s) for s in (1, 2, 3)]
    store.update(jobs[0].id, status="completed", progress=100)
    store.update(jobs[1].id, status="in_progress", progress=60)
    sync_job = submit(first, seed=9, sync=True)
    orphan = new_job_id()
    files.inputs_dir(orphan)
    bad_request = replace(jobs[2], id=new_job_id(), request=replace(jobs[2].request, steps=500))
    store.insert(bad_request)

    second = make()
    second.start()
    for job in jobs[1:]:
        assert wait_until(lambda j=job: finished(store, j.id)).status == "completed"
    assert [p.seed for p in second.executor.plans] == [2, 3]  # the completed job did not run again
    assert store.get(sync_job.id) is None and not files.job_dir(orphan).exists()
    failed = store.get(bad_request.id)
    assert failed.status == "failed" and failed.error.code == "invalid_request" and "steps" in failed.error.message


def test_close_puts_the_running_job_back_in_the_queue(env):
    make, store, _ = env
    first = make(FakeExecutor(step_s=0.05))
    first.start()
    job = submit(first, steps=200)
    wait_until(lambda: store.get(job.id).progress >= 1)
    first.close()
    assert (store.get(job.id).status, store.get(job.id).progress) == ("queued", 0)
    second = make(FakeExecutor(step_s=0.001))
    second.start()
    assert wait_until(lambda: finished(store, job.id)).status == "completed"


def test_expired_outputs_are_swept_and_the_record_stays(env):
    make, store, files = env
    clock = Clock()
    manager = make(output_ttl_s=10, clock=clock)
    manager.start()
    submitted = submit(manager)
    job = wait_until(lambda: finished(store, submitted.id))
    # The sweep leaves a job alone while the manager still holds it (it lets go just after recording it).
    wait_until(lambda: manager.done_event(submitted.id) is None, what="the manager letting go of the job")
    assert job.expires_at == int(clock.now) + 10
    clock.now += 9
    assert manager.sweep_expired() == 0 and files.job_dir(job.id).exists()
    clock.now += 2
    assert manager.sweep_expired() == 1
    assert not files.job_dir(job.id).exists() and store.get(job.id).expired


def test_done_event_wakes_a_waiter(env):
    make, store, _ = env
    manager = make()
    manager.start()
    job = submit(manager, sync=True)
    woke = threading.Event()
    event = manager.done_event(job.id)
    threading.Thread(target=lambda: event.wait(10) and woke.set(), daemon=True).start()
    assert woke.wait(10) and store.get(job.id).status == "completed"


def test_drain_answers_every_waiter_before_the_cancelled_run_lets_go(env):
    """Issue 32 item 8: a cancel lands only at the next step (on a busy host, later than the HTTP server waits
    for its requests), so a stop must not leave the waiter of the running job waiting for the run."""
    make, store, _ = env
    executor = FakeExecutor(step_s=0.02, ignore_cancel=True)  # the run lets go only when its ranks are closed
    manager = make(executor, max_queue=4)
    manager.start()
    running = submit(manager, steps=200, sync=True)
    queued = submit(manager, seed=2, sync=True)
    wait_until(lambda: store.get(running.id).progress >= 1, what="the job to run")
    events = {job.id: manager.done_event(job.id) for job in (running, queued)}
    assert not manager.drain(grace_s=0.05)  # the grace ran out with the job still running
    assert all(event.is_set() for event in events.values())
    assert manager.book.find(running.id) is not None  # answered while its run still holds it
    assert store.get(running.id).status == "in_progress" and store.get(queued.id).status == "queued"
    with pytest.raises(ShuttingDown):
        submit(manager, seed=3)
    executor.close()
    assert manager.join(10)
    assert (store.get(running.id).status, store.get(running.id).progress) == ("queued", 0)


def test_stop_answers_the_waiter_of_a_running_job_at_once(env):
    make, store, _ = env
    manager = make(FakeExecutor(step_s=0.02, ignore_cancel=True))
    manager.start()
    job = submit(manager, steps=200, sync=True)
    wait_until(lambda: store.get(job.id).progress >= 1, what="the job to run")
    event = manager.done_event(job.id)
    manager.stop()
    assert event.is_set() and manager.done_event(job.id) is None
    manager.executor.close()
    assert manager.join(10)
