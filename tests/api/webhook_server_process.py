"""`python webhook_server_process.py DATA_DIR PORT ALLOW_HOST JOB_STORE LEASE_S`: the real app, store, job manager
and webhook worker on a fake engine, as a process of its own (tests/api/test_webhook_durability.py kills it with
SIGKILL). JOB_STORE "" is the data dir's SQLite file. Fast webhook retries (webhook_servers.FAST_WEBHOOKS)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parents[1])]  # api_servers, fake_executor

from fake_executor import FakeExecutor  # noqa: E402
from webhook_servers import FAST_WEBHOOKS  # noqa: E402

from h3serve.api.app import create_app  # noqa: E402
from h3serve.api.http_server import build_server  # noqa: E402
from h3serve.api.server_config import ServerConfig  # noqa: E402
from h3serve.engine.jobs import JobManager  # noqa: E402
from h3serve.jobstore import open_job_store  # noqa: E402
from h3serve.jobstore.job_files import JobFiles  # noqa: E402
from h3serve.media.mp4 import EncoderOptions  # noqa: E402


def main(data_dir: str, port: str, allow_host: str, job_store: str, lease_s: str) -> None:
    config = ServerConfig(
        served_model_name="tiny", port=int(port), data_dir=Path(data_dir), job_store=job_store or None,
        job_lease_s=float(lease_s), webhook_allow_hosts=(allow_host,),
        # a hung attempt gives up after 2 s (its lease: 4 s), time enough for a test on a loaded host to see it held
        **{**FAST_WEBHOOKS, "webhook_timeout_s": 2.0},
    ).validate()
    store = open_job_store(config.job_store or config.store_path)
    manager = JobManager(FakeExecutor(step_s=0.005), store, JobFiles(config.jobs_dir), model_name="tiny",
                         encoder_options=EncoderOptions(preset="ultrafast"), lease_s=config.job_lease_s)
    build_server(create_app(config, manager, store), config, log_level="warning").run()


if __name__ == "__main__":
    main(*sys.argv[1:])
