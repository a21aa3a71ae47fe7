"""A server for hostile tests: the real app, store and job manager on a fake engine, with its own uvicorn."""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx
from api_servers import API_KEY, free_port, wait_healthy
from fake_executor import FakeExecutor

from h3serve.api.app import create_app
from h3serve.api.server_config import ServerConfig
from h3serve.api.url_fetch import MediaFetcher
from h3serve.engine.jobs import JobManager
from h3serve.jobstore.job_files import JobFiles
from h3serve.jobstore.sqlite import SQLiteJobStore
from h3serve.media.mp4 import EncoderOptions

HEALTH_BUDGET_S = 1.0  # /health must answer within this, during and after every attack


@dataclass
class HostileServer:
    url: str
    port: int
    executor: FakeExecutor
    manager: JobManager
    store: SQLiteJobStore
    config: ServerConfig
    app: Any = None  # the FastAPI app (its state.context)

    def client(self, key: str | None = API_KEY, timeout_s: float = 30) -> httpx.Client:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=timeout_s)

    def health_s(self) -> float:
        """Seconds /health took; AssertionError if it did not answer 200 within HEALTH_BUDGET_S."""
        start = time.monotonic()
        response = httpx.get(f"{self.url}/health", timeout=HEALTH_BUDGET_S)
        took = time.monotonic() - start
        assert response.status_code == 200, response.text
        assert took < HEALTH_BUDGET_S, f"/health took {took:.2f} s"
        return took


@contextlib.contextmanager
def serve(
    data_dir: Path, executor: FakeExecutor | None = None, fetcher: MediaFetcher | None = None, **config: Any
) -> Iterator[HostileServer]:
    """The app on `executor` (default: a fast fake), with `config` overriding ServerConfig fields."""
    from h3serve.api.http_server import build_server

    port = free_port()
    server_config = replace(
        ServerConfig(
            served_model_name="tiny",
            port=port,
            api_key=API_KEY,
            data_dir=data_dir,
            max_queue=4,
            sync_timeout_s=5.0,
            poll_after_ms=50,
            shutdown_grace_s=1.0,  # a test server stops in about a second even with a job running
        ),
        **config,
    ).validate()
    executor = executor or FakeExecutor(step_s=0.01)
    store = SQLiteJobStore(server_config.store_path)
    manager = JobManager(
        executor,
        store,
        JobFiles(server_config.jobs_dir),
        model_name=server_config.served_model_name,
        max_request_cost=server_config.max_request_cost,
        max_queue=server_config.max_queue,
        encoder_options=EncoderOptions(preset="ultrafast"),
        job_timeout_s=server_config.job_timeout_s,
        stall_timeout_s=server_config.stall_timeout_s,
    )
    app = create_app(server_config, manager, store, fetcher)
    uv = build_server(app, server_config, log_level="warning")
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, 30)
        yield HostileServer(url, port, executor, manager, store, server_config, app)
    finally:
        uv.should_exit = True
        thread.join(30)
        store.close()


def closed_by_server(sock: socket.socket, within_s: float) -> bytes | None:
    """What the server sent before closing, or None if the connection was still open after `within_s`."""
    sock.settimeout(within_s)
    received = b""
    try:
        while chunk := sock.recv(4096):
            received += chunk
    except TimeoutError:
        return None
    except ConnectionResetError:
        pass
    return received


@contextlib.contextmanager
def uvicorn_errors() -> Iterator[list[str]]:
    """uvicorn's error lines ("Cancel 1 running task(s)", "Exception in ASGI application"); its logger does not
    propagate to pytest's capture."""
    lines: list[str] = []
    handler = logging.Handler(logging.ERROR)
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("uvicorn.error")
    logger.addHandler(handler)
    try:
        yield lines
    finally:
        logger.removeHandler(handler)
