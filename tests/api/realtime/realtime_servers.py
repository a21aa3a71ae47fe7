"""The app on a fake real-time engine (tests/fake_realtime.py), behind the hardened HTTP server, in a thread."""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from api_servers import API_KEY, free_port, wait_healthy
from fake_realtime import FakeRealtimeExecutor

from h3serve.api.app import create_app
from h3serve.api.http_server import build_server
from h3serve.api.server_config import ServerConfig
from h3serve.engine.jobs import JobManager
from h3serve.jobstore.job_files import JobFiles
from h3serve.jobstore.sqlite import SQLiteJobStore
from h3serve.media.mp4 import EncoderOptions


@dataclass
class RealtimeServer:
    url: str
    executor: FakeRealtimeExecutor
    manager: JobManager
    errors: list[str]  # what the server logged at level error (uvicorn's "Exception in ASGI application" included)

    @property
    def ws_url(self) -> str:
        return self.url.replace("http://", "ws://") + "/v1/realtime/video"

    def idle(self) -> bool:
        """No session holds a replica and the engine's lock is free (nothing leaked)."""
        free = self.executor._lock.acquire(blocking=False)
        if free:
            self.executor._lock.release()
        return free and not any(self.manager.book.in_session(i) for i in range(len(self.manager.executors)))


@contextlib.contextmanager
def serve_realtime(data_dir: Path, executor: FakeRealtimeExecutor | None = None,
                   **config: Any) -> Iterator[RealtimeServer]:
    port = free_port()
    settings = dict(served_model_name="tiny", port=port, api_key=API_KEY, data_dir=data_dir, realtime=True,
                    realtime_start_timeout_s=1.0, realtime_stall_timeout_s=1.5, shutdown_grace_s=1.0)
    server_config = ServerConfig(**{**settings, **config}).validate()
    executor = executor or FakeRealtimeExecutor()
    store = SQLiteJobStore(server_config.store_path)
    manager = JobManager(executor, store, JobFiles(server_config.jobs_dir), model_name="tiny",
                         encoder_options=EncoderOptions(preset="ultrafast"))
    uv = build_server(create_app(server_config, manager, store), server_config, log_level="warning")
    errors: list[str] = []
    handler = logging.Handler(logging.ERROR)
    handler.emit = lambda record: errors.append(record.getMessage())  # type: ignore[method-assign]
    loggers = [logging.getLogger(name) for name in ("uvicorn.error", "h3serve")]
    for logger in loggers:
        logger.addHandler(handler)
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, 30)
        yield RealtimeServer(url, executor, manager, errors)
    finally:
        uv.should_exit = True
        thread.join(30)
        store.close()
        for logger in loggers:
            logger.removeHandler(handler)
