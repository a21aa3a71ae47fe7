"""Webhook test helpers: the app on a fake engine with fast webhook settings, in a thread or as a process a test
can `kill -9` (the scripted receiver is tests/webhook_receiver.py)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx
from api_servers import API_KEY, free_port, wait_healthy
from fake_executor import FakeExecutor

from h3serve.api.app import create_app
from h3serve.api.http_server import build_server
from h3serve.api.server_config import ServerConfig
from h3serve.engine.jobs import JobManager
from h3serve.jobstore import open_job_store
from h3serve.jobstore.job_files import JobFiles
from h3serve.jobstore.store import JobStore
from h3serve.media.mp4 import EncoderOptions

# Fast retries and polls, so a failing-then-recovering receiver takes a fraction of a second.
FAST_WEBHOOKS: dict[str, Any] = {"webhook_retry_initial_s": 0.05, "webhook_poll_s": 0.05, "webhook_timeout_s": 2.0}
PROCESS_SCRIPT = Path(__file__).with_name("webhook_server_process.py")


@dataclass
class WebhookServer:
    url: str
    executor: FakeExecutor
    manager: JobManager
    store: JobStore
    config: ServerConfig
    app: Any

    def client(self, key: str | None = API_KEY) -> httpx.Client:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=30)


@contextlib.contextmanager
def serve_webhooks(data_dir: Path, job_store: str | None = None, **config: Any) -> Iterator[WebhookServer]:
    """The real app, store and job manager on a fake engine, with fast webhook retries, in a uvicorn thread."""
    server_config = replace(
        ServerConfig(served_model_name="tiny", port=free_port(), api_key=API_KEY, data_dir=data_dir, max_queue=8,
                     job_store=job_store, shutdown_grace_s=1.0, **FAST_WEBHOOKS),
        **config,
    ).validate()
    executor = FakeExecutor(step_s=0.005)
    store = open_job_store(job_store or server_config.store_path)
    manager = JobManager(executor, store, JobFiles(server_config.jobs_dir), model_name="tiny", max_queue=8,
                         encoder_options=EncoderOptions(preset="ultrafast"), lease_s=server_config.job_lease_s)
    app = create_app(server_config, manager, store)
    uv = build_server(app, server_config, log_level="warning")
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{server_config.port}"
    try:
        wait_healthy(url, 30)
        yield WebhookServer(url, executor, manager, store, server_config, app)
    finally:
        uv.should_exit = True
        thread.join(30)
        store.close()


@dataclass
class ServerProcess:
    """The app on a fake engine in its own process (webhook_server_process.py), for `kill -9`."""

    url: str
    proc: subprocess.Popen[bytes]
    log_path: Path

    def kill(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def start_process(data_dir: Path, allow_host: str, job_store: str = "", lease_s: float = 2.0) -> ServerProcess:
    port = free_port()
    data_dir.mkdir(parents=True, exist_ok=True)
    log_path = data_dir.parent / f"{data_dir.name}-{port}.log"
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            [sys.executable, str(PROCESS_SCRIPT), str(data_dir), str(port), allow_host, job_store, str(lease_s)],
            stdout=log, stderr=subprocess.STDOUT, cwd=Path(__file__).parent,
        )
    server = ServerProcess(f"http://127.0.0.1:{port}", proc, log_path)
    try:
        wait_healthy(server.url, 60, proc)
    except RuntimeError as e:
        server.stop()
        raise RuntimeError(f"{e}\n--- server log ---\n{server.log()}") from None
    return server
