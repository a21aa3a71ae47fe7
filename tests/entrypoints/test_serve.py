"""`h3serve serve` start-up and shutdown without a model: the data-dir lock, a data dir that cannot hold the
jobs, an output-store bucket that cannot be reached or used, and the shutdown order that keeps the running job (a
fake engine stands in for the rank processes)."""

from __future__ import annotations

import math
import os
import sqlite3
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from fake_executor import FakeExecutor
from waiting import wait_until

from h3serve.api.data_lock import DataDirBusy, DataDirLock
from h3serve.api.http_server import H3Server
from h3serve.api.server_config import ServerConfig
from h3serve.engine.jobs import JobManager
from h3serve.entrypoints import serve as serve_cli
from h3serve.jobstore.job_files import JobFiles
from h3serve.jobstore.sqlite import SQLiteJobStore
from h3serve.rules.request import GenerationRequest

# Only logged (the engine is a fake); one replica.
ENGINE_CONFIG = SimpleNamespace(model=Path("tiny"), device="cpu", data_parallel_size=1, lora_paths=(), lora_dir=None)


class RecordedExecutor(FakeExecutor):
    """Stands in for `Executor(config, rendezvous=...)`; every one started is recorded."""

    started: list[RecordedExecutor] = []

    def __init__(self, config, rendezvous=None):
        super().__init__()
        RecordedExecutor.started.append(self)


def _never_serve(*args, **kwargs) -> None:
    raise AssertionError("the server got as far as serving")


@pytest.fixture
def engines(monkeypatch) -> list[RecordedExecutor]:
    """The engines `run_server` starts (fakes); it never reaches uvicorn, so a regression fails, not hangs."""
    import h3serve.engine.executor

    RecordedExecutor.started = []
    monkeypatch.setattr(h3serve.engine.executor, "Executor", RecordedExecutor)
    monkeypatch.setattr(H3Server, "run", _never_serve)
    return RecordedExecutor.started


def config(data_dir: Path) -> ServerConfig:
    return ServerConfig(served_model_name="tiny", data_dir=data_dir, port=0).validate()  # never bound: run is a fake


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err, err
    return err


def test_the_data_dir_lock_admits_one_holder(tmp_path):
    with DataDirLock(tmp_path / "data") as held:
        assert held.path.read_text().strip() == str(os.getpid())
        with pytest.raises(DataDirBusy, match=f"in use by another h3serve server \\(pid {os.getpid()}\\)"):
            DataDirLock(tmp_path / "data").acquire()
    with DataDirLock(tmp_path / "data"):  # released on exit
        pass


def test_a_second_server_on_a_data_dir_fails_before_its_engine_starts(tmp_path, engines, capsys):
    with DataDirLock(tmp_path):
        assert serve_cli.run_server(ENGINE_CONFIG, config(tmp_path)) == 1
    assert "in use by another h3serve server" in one_line_error(capsys)
    assert engines == []


def _newer_schema(data_dir: Path) -> None:
    with sqlite3.connect(data_dir / "jobs.sqlite3") as db:
        db.execute("PRAGMA user_version=999")


@pytest.mark.parametrize(
    "spoil, expected",
    [
        (_newer_schema, "newer than this h3serve"),
        (lambda d: (d / "jobs.sqlite3").write_bytes(b"not a database" * 100), "not a database"),
        (lambda d: (d / "jobs").write_text("a file where the jobs folder goes"), "File exists"),
    ],
)
def test_a_data_dir_that_cannot_hold_the_jobs_is_a_one_line_error(tmp_path, engines, capsys, spoil, expected):
    spoil(tmp_path)
    assert serve_cli.run_server(ENGINE_CONFIG, config(tmp_path)) == 1
    assert expected in one_line_error(capsys)
    assert engines == []  # checked before the engine loads
    DataDirLock(tmp_path).acquire()  # and the lock was let go


def test_a_bucket_that_cannot_be_used_refuses_the_start_before_the_engine(tmp_path, engines, capsys, ceph_gateway,
                                                                         bucket, aws_env, monkeypatch):
    from ceph_gateway import SECRET_KEY, free_port

    def start(store: str, endpoint: str) -> str:
        server_config = ServerConfig(served_model_name="tiny", data_dir=tmp_path, port=0, output_store=store,
                                     s3_endpoint_url=endpoint).validate()
        assert serve_cli.run_server(ENGINE_CONFIG, server_config) == 1
        return one_line_error(capsys)

    dead = f"http://127.0.0.1:{free_port()}"
    assert start(f"s3://{bucket}/h3", dead) == (
        f"error: --output-store: the bucket s3://{bucket}/h3 at {dead}: the start-up check (HEAD bucket, write and "
        "delete a probe object) failed: cannot reach the S3 endpoint")
    assert start("s3://h3serve-no-such-bucket/h3", ceph_gateway.endpoint_url).endswith("the bucket does not exist")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY[::-1])
    refused = start(f"s3://{bucket}", ceph_gateway.endpoint_url)
    assert "access denied" in refused
    assert SECRET_KEY[::-1] not in refused and aws_env["AWS_ACCESS_KEY_ID"] not in refused
    assert engines == []  # refused before the engine loads
    DataDirLock(tmp_path).acquire()  # and the data dir's lock was let go


def test_a_server_that_fails_after_the_engine_started_closes_it(tmp_path, engines, monkeypatch):
    def port_in_use(*args, **kwargs):
        raise SystemExit(1)  # what uvicorn does when it cannot bind

    monkeypatch.setattr(H3Server, "run", port_in_use)
    with pytest.raises(SystemExit):
        serve_cli.run_server(ENGINE_CONFIG, config(tmp_path))
    assert [e.closed for e in engines] == [True]
    DataDirLock(tmp_path).acquire()


def test_shut_down_requeues_the_running_job_before_the_store_closes(tmp_path):
    store = SQLiteJobStore(tmp_path / "jobs.sqlite3")
    executor = FakeExecutor(step_s=0.02, ignore_cancel=True)  # a step longer than the lifespan waits for
    manager = JobManager(executor, store, JobFiles(tmp_path / "jobs"), model_name="tiny", max_request_cost=math.inf)
    manager.start()
    request = GenerationRequest(prompt="waves", width=128, height=64, duration_s=4, steps=200)
    job = manager.submit(request, seconds="4")
    wait_until(lambda: store.get(job.id).progress >= 1, what="the job to run")
    manager.close(timeout_s=0.1)  # the app's lifespan gives up waiting
    serve_cli.shut_down(manager, executor, store)
    reopened = SQLiteJobStore(tmp_path / "jobs.sqlite3")
    try:
        assert (reopened.get(job.id).status, reopened.get(job.id).progress) == ("queued", 0)
    finally:
        reopened.close()


@pytest.mark.parametrize(
    "module, forbidden",
    [
        ("h3serve.api.app", "torch"),  # the API process never loads the model's stack
        ("h3serve.entrypoints.serve", "torch"),  # `h3serve serve`'s process is the API process
        ("h3serve.entrypoints.serve", "h3serve.entrypoints.cli"),  # no upward import (and no cycle) to the CLI
    ],
)
def test_serve_modules_import_without(module, forbidden):
    code = f"import sys, {module}; assert {forbidden!r} not in sys.modules, 'imported {forbidden}'"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
