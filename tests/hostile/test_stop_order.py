"""Issue 32 item 8: the server stops in a strict order, whatever each step costs.

stop taking work -> answer every waiter -> close the store. Each test injects a delay at a step (a run whose
cancel lands late, a hook that holds a step until the test has looked, a slow store call) and runs the stop the
way `h3serve serve` does: uvicorn's shutdown (the drain, the requests, the lifespan), then `shut_down` (the ranks,
the runner, the store). Before the fix, a /sync waiter whose run had not let go when uvicorn's graceful timeout
ran out was cancelled, and uvicorn answered a plain-text 500.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from api_servers import API_KEY, free_port, wait_healthy
from fake_executor import FakeExecutor
from hostile_servers import uvicorn_errors
from waiting import wait_until

from h3serve.api.app import create_app
from h3serve.api.http_server import build_server
from h3serve.api.server_config import ServerConfig
from h3serve.engine.jobs import JobManager
from h3serve.entrypoints import serve as serve_cli
from h3serve.jobstore.job_files import JobFiles
from h3serve.jobstore.sqlite import SQLiteJobStore
from h3serve.media.mp4 import EncoderOptions

GRACE_S = 0.2  # --shutdown-grace
REQUESTS_WAIT_S = 1.0  # uvicorn's timeout_graceful_shutdown (5 s in production): then it cancels the requests
CANCEL_LANDS_S = 2.5  # a step slower than both: the run lets go of its job only this long after the cancel
STEP_2_DELAY_S = 1.0  # step 1 -> step 2 (after the grace): the queued job's waiter is answered well before
SYNC_BODY = {"prompt": "x", "size": "128x64", "seconds": "4", "num_inference_steps": 200}


@dataclass
class Timeline:
    """What happened, in order, from every thread (the server's steps, the store's calls, the clients)."""

    events: list[tuple[float, str]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, what: str) -> None:
        with self.lock:
            self.events.append((time.monotonic(), what))

    def at(self, what: str) -> float:
        return next(t for t, name in self.events if name == what)

    def names(self, prefix: str = "") -> list[str]:
        return [name for _, name in self.events if name.startswith(prefix)]


class RecordingStore(SQLiteJobStore):
    """The SQLite store, its calls and its close on the timeline."""

    timeline: Timeline

    def _run(self, sql: str, params: Any = ()) -> Any:
        try:
            return super()._run(sql, params)
        finally:
            self.timeline.add("store call")

    def close(self) -> None:
        self.timeline.add("close the store")
        super().close()


class LateCancelExecutor(FakeExecutor):
    """A run notices its cancel only `CANCEL_LANDS_S` later, as a long step on a busy host would."""

    def cancel(self, seq: int) -> None:
        timer = threading.Timer(CANCEL_LANDS_S, super().cancel, args=(seq,))
        timer.daemon = True
        timer.start()


@dataclass
class Stopping:
    url: str
    manager: JobManager
    store: RecordingStore
    timeline: Timeline
    stop: Callable[[], None]  # SIGTERM, as uvicorn's handler takes it
    stopped: threading.Event  # `shut_down` has returned


@contextlib.contextmanager
def server(data_dir: Path, timeline: Timeline) -> Iterator[Stopping]:
    """The real app and stop path on `LateCancelExecutor`, in a thread; the test stops it."""
    port = free_port()
    config = ServerConfig(served_model_name="tiny", port=port, api_key=API_KEY, data_dir=data_dir, max_queue=4,
                          sync_timeout_s=60, shutdown_grace_s=GRACE_S, max_request_cost=math.inf).validate()
    executor = LateCancelExecutor(step_s=0.02)
    RecordingStore.timeline = timeline
    store = RecordingStore(config.store_path)
    manager = JobManager(executor, store, JobFiles(config.jobs_dir), model_name="tiny", max_request_cost=math.inf,
                         max_queue=4, encoder_options=EncoderOptions(preset="ultrafast"))
    uv = build_server(create_app(config, manager, store), config, log_level="warning",
                      timeout_graceful_shutdown=REQUESTS_WAIT_S)
    stopped = threading.Event()

    def serve() -> None:  # as serve_cli._serve_leader: run, then the ranks, the runner and the store
        try:
            uv.run()
        finally:
            serve_cli.shut_down(manager, executor, store)
            stopped.set()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, 30)
        yield Stopping(url, manager, store, timeline, lambda: uv.handle_exit(15, None), stopped)
    finally:
        uv.should_exit = True
        thread.join(30)


def client() -> httpx.Client:
    return httpx.Client(headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30)


def post_in_thread(url: str, body: dict[str, Any], timeline: Timeline, name: str) -> tuple[threading.Thread, dict]:
    answer: dict[str, httpx.Response] = {}

    def post() -> None:
        with client() as http:
            answer["response"] = http.post(url, json=body)
        timeline.add(name)

    thread = threading.Thread(target=post, daemon=True)
    thread.start()
    return thread, answer


def assert_shutting_down(response: httpx.Response) -> None:
    assert response.status_code == 503, response.text
    assert response.headers["content-type"] == "application/json"
    assert response.json()["error"]["code"] == "shutting_down"


def test_a_sync_waiter_is_answered_json_503_though_its_run_lets_go_late(tmp_path):
    """The test_shutdown.py flake, made certain: the run lets go after uvicorn stopped waiting for requests."""
    timeline = Timeline()
    with server(tmp_path, timeline) as running, uvicorn_errors() as errors:
        thread, answer = post_in_thread(f"{running.url}/v1/videos/sync", SYNC_BODY, timeline, "answered")
        wait_until(lambda: running.manager.book.running(), what="the job to run")
        running.stop()
        thread.join(30)
        assert running.stopped.wait(30)
    assert_shutting_down(answer["response"])
    assert timeline.at("answered") < timeline.at("close the store")
    assert errors == []  # answered by the handler: uvicorn had no request to cancel, nothing to log


def test_each_step_ends_before_the_next_begins_with_delays_injected(tmp_path, monkeypatch):
    """A delay at every step: step 1 held until the test has checked that no work is taken, step 2 slowed, the
    answered requests' own store calls slowed, the run letting go late. The order holds regardless."""
    timeline = Timeline()
    go_on = threading.Event()
    stop_taking_work = JobManager.stop_taking_work
    answer_waiters = JobManager.answer_waiters
    delete = JobManager.delete

    def held_stop_taking_work(self: JobManager) -> None:
        stop_taking_work(self)
        if "stop taking work" not in timeline.names():
            timeline.add("stop taking work")
            assert go_on.wait(10)  # step 1 -> step 2 delay: as long as the test needs

    def slow_answer_waiters(self: JobManager, *, keep_held: bool = False) -> None:
        if not keep_held and "answer every waiter" not in timeline.names():  # the drain's; close and
            time.sleep(STEP_2_DELAY_S)  # shut_down answer (nobody) again
            timeline.add("answer every waiter")
        answer_waiters(self, keep_held=keep_held)

    def slow_delete(self: JobManager, job_id: str) -> bool:
        timeline.add("a sync waiter answered")  # its handler has its answer and now removes the job
        time.sleep(0.3)  # the store must still be open when the removal comes
        try:
            return delete(self, job_id)
        finally:
            timeline.add("a sync job removed")

    monkeypatch.setattr(JobManager, "stop_taking_work", held_stop_taking_work)
    monkeypatch.setattr(JobManager, "answer_waiters", slow_answer_waiters)
    monkeypatch.setattr(JobManager, "delete", slow_delete)
    with server(tmp_path, timeline) as running, client() as keep_alive:
        assert keep_alive.get(f"{running.url}/health").status_code == 200  # a connection open before the stop
        first, first_answer = post_in_thread(f"{running.url}/v1/videos/sync", SYNC_BODY, timeline, "answered 1")
        wait_until(lambda: running.manager.book.running(), what="the first job to run")
        second, second_answer = post_in_thread(f"{running.url}/v1/videos/sync", {**SYNC_BODY, "seed": 2},
                                               timeline, "answered 2")
        wait_until(lambda: running.manager.queue_depth == 1, what="the second job to queue")
        running.stop()
        wait_until(lambda: "stop taking work" in timeline.names(), what="step 1")
        late = keep_alive.post(f"{running.url}/v1/videos", json=SYNC_BODY)  # held in step 1: no work is taken
        assert_shutting_down(late)
        assert running.manager.queue_depth == 1 and not first_answer
        go_on.set()
        first.join(30)
        second.join(30)
        assert running.stopped.wait(30)
    assert_shutting_down(first_answer["response"])
    assert_shutting_down(second_answer["response"])
    names = timeline.names()
    steps = ["stop taking work", "answer every waiter", "answered 1", "close the store"]
    assert [n for n in names if n in steps] == steps, names
    answered = [t for t, name in timeline.events if name == "a sync waiter answered"]
    assert len(answered) == 2 and answered[0] < timeline.at("answer every waiter")  # the queued job's: at once
    closed = timeline.at("close the store")
    removed = [t for t, name in timeline.events if name == "a sync job removed"]
    assert len(removed) == 2 and max(removed) < closed
    assert all(t <= closed for t, name in timeline.events if name == "store call")  # nothing after the close


def test_a_request_the_server_had_to_cancel_ends_before_the_store_closes(tmp_path, monkeypatch):
    """Step 2 skipped (no waiter answered): uvicorn cancels the /sync request, which answers JSON 503 and then
    removes its job in a slow store call. The stop waits for that call before the store closes."""
    timeline = Timeline()
    delete = JobManager.delete

    def slow_delete(self: JobManager, job_id: str) -> bool:
        time.sleep(CANCEL_LANDS_S + 1.0)  # outlasts the lifespan's wait for the run
        try:
            return delete(self, job_id)
        finally:
            timeline.add("a sync job removed")

    monkeypatch.setattr(JobManager, "answer_waiters", lambda self, **kw: None)
    monkeypatch.setattr(JobManager, "delete", slow_delete)
    with server(tmp_path, timeline) as running:
        thread, answer = post_in_thread(f"{running.url}/v1/videos/sync", SYNC_BODY, timeline, "answered")
        wait_until(lambda: running.manager.book.running(), what="the job to run")
        running.stop()
        thread.join(30)
        assert running.stopped.wait(30)
        wait_until(lambda: "a sync job removed" in timeline.names(), what="the removal")
    assert_shutting_down(answer["response"])  # by LastResort: the request was cancelled
    closed = timeline.at("close the store")
    assert timeline.at("a sync job removed") < closed
    assert all(t <= closed for t, name in timeline.events if name == "store call")
