"""The module-scoped API server on a fake engine (see api_servers.py for the helpers)."""

from __future__ import annotations

import threading

import pytest
import uvicorn
from api_servers import API_KEY, FakeServer, free_port, wait_healthy
from fake_executor import FakeExecutor

from h3serve.api.app import create_app
from h3serve.api.server_config import ServerConfig
from h3serve.engine.jobs import JobManager
from h3serve.jobstore.job_files import JobFiles
from h3serve.jobstore.sqlite import SQLiteJobStore
from h3serve.media.mp4 import EncoderOptions


@pytest.fixture(scope="module")
def fake_server(tmp_path_factory) -> FakeServer:
    """The real app, store and job manager on a fake engine (no model), served by uvicorn in a thread."""
    data_dir = tmp_path_factory.mktemp("data")
    config = ServerConfig(
        served_model_name="tiny", port=free_port(), api_key=API_KEY, data_dir=data_dir, max_queue=4,
        sync_timeout_s=2.0, poll_after_ms=50,
    ).validate()
    executor = FakeExecutor(step_s=0.01)
    store = SQLiteJobStore(config.store_path)
    files = JobFiles(config.jobs_dir)
    manager = JobManager(executor, store, files, model_name=config.served_model_name, max_queue=config.max_queue,
                         output_ttl_s=3600,
                         encoder_options=EncoderOptions(preset="ultrafast"))
    server = uvicorn.Server(uvicorn.Config(create_app(config, manager, store), host="127.0.0.1", port=config.port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{config.port}"
    wait_healthy(url, 30)
    yield FakeServer(url, executor, manager, store, files, config)
    server.should_exit = True
    thread.join(30)
    store.close()
