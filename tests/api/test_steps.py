"""num_inference_steps over HTTP: denoiser forwards, its limits, and a checkpoint's pinned schedule (a 400 naming
the pin's owner and its count)."""

from __future__ import annotations

import dataclasses

import pytest
from fake_executor import TINY_DEFAULTS, FakeExecutor
from fastapi.testclient import TestClient
from waiting import wait_until

from h3serve.api.app import create_app
from h3serve.api.server_config import ServerConfig
from h3serve.engine.jobs import JobManager
from h3serve.jobstore.job_files import JobFiles
from h3serve.jobstore.sqlite import SQLiteJobStore
from h3serve.media.mp4 import EncoderOptions
from h3serve.rules.schedule import PinnedSchedule

REQUEST = {"prompt": "waves", "size": "128x64", "seconds": "4"}
FASTH3 = PinnedSchedule("adapter 'fasth3'", positions=(0.999, 0.749, 0.5, 0.25, 0.0))


def serve(tmp_path, pin: PinnedSchedule | None):
    config = ServerConfig(served_model_name="tiny", data_dir=tmp_path).validate()
    store = SQLiteJobStore(config.store_path)
    executor = FakeExecutor(step_s=0.001)
    executor.defaults = dataclasses.replace(TINY_DEFAULTS, pinned_schedule=pin)
    manager = JobManager(executor, store, JobFiles(config.jobs_dir), model_name=config.served_model_name,
                         encoder_options=EncoderOptions(preset="ultrafast"))
    return TestClient(create_app(config, manager, store)), executor, store


def error_of(response) -> tuple[str, str]:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    return error["param"], error["message"]


def finished(client: TestClient, video_id: str) -> dict:
    wait_until(lambda: client.get(f"/v1/videos/{video_id}").json()["status"] in ("completed", "failed"), 20)
    return client.get(f"/v1/videos/{video_id}").json()


@pytest.mark.parametrize("steps", [0, -1, 201])
def test_out_of_range_steps_are_400_naming_the_field_and_limits(tmp_path, steps):
    client, _, store = serve(tmp_path, None)
    with client:
        param, message = error_of(client.post("/v1/videos", json={**REQUEST, "num_inference_steps": steps}))
    store.close()
    assert param == "num_inference_steps" and "between 1 and 200" in message


def test_a_job_runs_n_forwards(tmp_path):
    client, executor, store = serve(tmp_path, None)
    with client:
        job = client.post("/v1/videos", json={**REQUEST, "num_inference_steps": 1}).json()
        assert finished(client, job["id"])["status"] == "completed"
        job = client.post("/v1/videos", json=REQUEST).json()  # the default: 50 forwards
        assert finished(client, job["id"])["status"] == "completed"
    store.close()
    assert [p.steps for p in executor.plans] == [1, 50]
    assert all(p.pinned_positions is None for p in executor.plans)


def test_a_pinned_schedule_takes_or_refuses_the_step_count(tmp_path):
    client, executor, store = serve(tmp_path, FASTH3)
    with client:
        param, message = error_of(client.post("/v1/videos", json={**REQUEST, "num_inference_steps": 8}))
        assert param == "num_inference_steps"
        assert message == ("num_inference_steps: adapter 'fasth3' runs exactly 4 steps (denoiser forwards); omit "
                           "the field or send 4, got 8")
        for body in (REQUEST, {**REQUEST, "num_inference_steps": 4}):
            job = client.post("/v1/videos", json=body).json()
            assert finished(client, job["id"])["status"] == "completed"
        assert client.get("/web/config").json()["defaults"]["steps"] == 4  # the page's default follows the pin
    store.close()
    assert [(p.steps, p.pinned_positions) for p in executor.plans] == [(4, FASTH3.positions)] * 2
