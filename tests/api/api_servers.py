"""Servers for the API tests: the app on a fake engine (served in a thread), and `h3serve serve` as a process."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from fake_executor import FakeExecutor

from h3serve.api.app import create_app
from h3serve.api.server_config import ServerConfig
from h3serve.engine.jobs import JobManager
from h3serve.jobstore.job_files import JobFiles
from h3serve.jobstore.sqlite import SQLiteJobStore
from h3serve.media.mp4 import EncoderOptions
from h3serve.output_store import open_output_store
from h3serve.tools.live_server import wait_healthy  # noqa: F401 (the other test helpers import it from here)

API_KEY = "test-key"
START_TIMEOUT_S = 180.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class FakeServer:
    url: str
    executor: FakeExecutor
    manager: JobManager
    store: SQLiteJobStore
    files: JobFiles
    config: ServerConfig

    def client(self, key: str | None = API_KEY) -> httpx.Client:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=30)


@contextlib.contextmanager
def serve_fake(data_dir: Path, executor: FakeExecutor | None = None, manager_options: dict[str, Any] | None = None,
               **config: Any) -> Iterator[FakeServer]:
    """The real app, store, job manager and output store (`output_store` / `s3_endpoint_url` in `config`; the data
    dir by default) on a fake engine, served by uvicorn in a thread until the block ends."""
    config = ServerConfig(served_model_name="tiny", port=free_port(), api_key=API_KEY, data_dir=data_dir,
                          **{"max_queue": 4, "sync_timeout_s": 2.0, "poll_after_ms": 50, **config}).validate()
    executor = executor or FakeExecutor(step_s=0.01)
    store = SQLiteJobStore(config.store_path)
    files = JobFiles(config.jobs_dir)
    outputs = open_output_store(config.output_store, files, config.s3_endpoint_url)
    manager = JobManager(executor, store, files, model_name=config.served_model_name, max_queue=config.max_queue,
                         output_ttl_s=3600, encoder_options=EncoderOptions(preset="ultrafast"), outputs=outputs,
                         upload_attempts=config.output_upload_attempts, **(manager_options or {}))
    server = uvicorn.Server(uvicorn.Config(create_app(config, manager, store), host="127.0.0.1", port=config.port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{config.port}"
    wait_healthy(url, 30)
    try:
        yield FakeServer(url, executor, manager, store, files, config)
    finally:
        server.should_exit = True
        thread.join(30)
        store.close()


@dataclass
class LiveServer:
    """`h3serve serve` in its own process group (its rank processes included)."""

    url: str
    proc: subprocess.Popen
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def kill(self) -> None:
        """SIGKILL the server process only, as a crash would (its rank processes are left to notice)."""
        self.proc.kill()
        self.proc.wait(30)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        try:  # whatever is left of the group (rank processes of a killed server)
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def start_live_server(checkpoint: Path, data_dir: Path, *args: str, port: int | None = None,
                      env: dict[str, str] | None = None) -> LiveServer:
    port = port or free_port()
    log_path = data_dir.parent / f"{data_dir.name}-server-{port}.log"
    command = [
        sys.executable, "-m", "h3serve", "serve", str(checkpoint), "--port", str(port), "--data-dir",
        str(data_dir), "--x264-preset", "ultrafast", "--log-level", "warning", "--warmup", "off", *args,
    ]
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env=None if env is None else {**os.environ, **env})
    server = LiveServer(f"http://127.0.0.1:{port}", proc, log_path)
    try:
        wait_healthy(server.url, START_TIMEOUT_S, proc)
    except RuntimeError as e:
        server.stop()
        raise RuntimeError(f"{e}\n--- server log ---\n{server.log()}") from None
    return server
