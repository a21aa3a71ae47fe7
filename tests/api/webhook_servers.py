"""Webhook test helpers: a scripted receiver on loopback, the app on a fake engine with webhook settings (in a
thread, or as a process a test can `kill -9`), and a wait for deliveries."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
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
from h3serve.jobstore.protocol import JobStore
from h3serve.media.mp4 import EncoderOptions

HANG = -1  # a scripted answer: hold the request until `Receiver.release()`
# Fast retries and polls, so a failing-then-recovering receiver takes a fraction of a second.
FAST_WEBHOOKS: dict[str, Any] = {"webhook_retry_initial_s": 0.05, "webhook_poll_s": 0.05, "webhook_timeout_s": 2.0}
PROCESS_SCRIPT = Path(__file__).with_name("webhook_server_process.py")


@dataclass
class Received:
    path: str
    headers: dict[str, str]
    body: bytes


@dataclass
class Receiver:
    """Records every POST; answers each with the next scripted status (then 200). A 307/308 answer redirects to
    `redirect_to`; `HANG` holds the request until `release()`."""

    server: ThreadingHTTPServer
    received: list[Received] = field(default_factory=list)
    script: list[int] = field(default_factory=list)
    redirect_to: str = ""
    released: threading.Event = field(default_factory=threading.Event)
    arrived: threading.Condition = field(default_factory=threading.Condition)

    @property
    def port(self) -> int:
        return self.server.server_address[1]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hook"

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.port}"

    def answer(self, *statuses: int) -> None:
        self.script[:] = statuses
        self.released.clear()

    def release(self) -> None:
        self.released.set()

    def wait_for(self, count: int, timeout_s: float = 20.0) -> list[Received]:
        """The first `count` requests, once they have come."""
        with self.arrived:
            if not self.arrived.wait_for(lambda: len(self.received) >= count, timeout_s):
                raise AssertionError(f"{len(self.received)} of {count} webhook requests came in {timeout_s:g} s")
            return self.received[:count]


def _handler(receiver: Receiver) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
            body = self.rfile.read(int(self.headers.get("content-length", 0)))
            status = receiver.script.pop(0) if receiver.script else 200
            with receiver.arrived:
                receiver.received.append(Received(self.path, {k.lower(): v for k, v in self.headers.items()}, body))
                receiver.arrived.notify_all()
            if status == HANG:
                receiver.released.wait(30)
                status = 200
            self.send_response(status)
            if status in (307, 308):
                self.send_header("Location", receiver.redirect_to)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"ok")

    return Handler


@contextlib.contextmanager
def receiver() -> Iterator[Receiver]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), BaseHTTPRequestHandler)
    got = Receiver(server)
    server.RequestHandlerClass = _handler(got)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield got
    finally:
        got.release()
        server.shutdown()
        server.server_close()


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
