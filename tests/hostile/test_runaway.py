"""Defect 3: a runaway request is refused by cost, bounded by --job-timeout, and a stuck engine is unhealthy."""

from __future__ import annotations

import threading

import pytest
from fake_executor import TINY_DEFAULTS
from hostile_servers import serve
from waiting import wait_until

from h3serve.engine.admission import default_max_cost, request_cost
from h3serve.rules.request import GenerationRequest
from h3serve.rules.validate import validate


def test_the_cost_model_orders_the_issue_s_runaway_far_past_the_default_limit():
    from h3serve.rules.validate import ModelDefaults

    real = ModelDefaults()
    runaway = validate(GenerationRequest(prompt="x", width=4096, height=4096, duration_s=15, steps=200), real)
    ordinary = validate(GenerationRequest(prompt="x", width=1792, height=1024, duration_s=15, steps=50), real)
    assert request_cost(ordinary) < default_max_cost(real) < request_cost(runaway) / 30


def test_a_request_over_the_cost_limit_is_400_naming_the_limit(server):
    limit = default_max_cost(TINY_DEFAULTS)
    before = server.store.ids()
    with server.client() as client:
        response = client.post(
            "/v1/videos", json={"prompt": "x", "size": "4096x4096", "seconds": "15", "num_inference_steps": 200}
        )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "request_too_costly"
    assert f"{limit:,.0f}" in error["message"] and "--max-request-cost" in error["message"]
    assert server.store.ids() == before  # refused before anything was stored


def test_max_request_cost_is_configurable(tmp_path):
    cheap = {"prompt": "x", "size": "128x64", "seconds": "4", "num_inference_steps": 10}  # 8192 x 107 x 10 / 1e6
    with serve(tmp_path, max_request_cost=5.0) as server, server.client() as client:
        refused = client.post("/v1/videos", json=cheap)
        accepted = client.post("/v1/videos", json={**cheap, "num_inference_steps": 2})
    assert refused.status_code == 400 and "limit of 5" in refused.json()["error"]["message"]
    assert accepted.status_code == 200


def test_a_job_past_job_timeout_fails_clearly_and_frees_the_engine(tmp_path):
    with serve(tmp_path, job_timeout_s=0.5) as server, server.client() as client:
        server.executor.step_s = 0.05  # 200 steps: 10 s
        slow = client.post("/v1/videos", json={"prompt": "x", "size": "128x64", "num_inference_steps": 200}).json()
        quick = client.post("/v1/videos", json={"prompt": "x", "size": "128x64", "num_inference_steps": 3}).json()

        def status(video_id: str) -> str:
            return client.get(f"/v1/videos/{video_id}").json()["status"]

        wait_until(lambda: status(slow["id"]) == "failed", 5, "the slow job to time out")
        error = client.get(f"/v1/videos/{slow['id']}").json()["error"]
        assert error["code"] == "timeout" and "0.5 s" in error["message"]
        wait_until(lambda: status(quick["id"]) == "completed", 5, "the next job to run")
        server.health_s()


@pytest.mark.parametrize("stall_s", [0.3])
def test_health_reports_a_stuck_engine(tmp_path, stall_s):
    """A step that never ends (here: a fake engine blocked on an event) makes /health 503 with the reason."""
    release = threading.Event()
    with serve(tmp_path) as server:
        server.manager.stall_timeout_s = stall_s
        original = server.executor.generate

        def stuck(plan, on_progress=None, on_start=None, timeout_s=None, **rest):
            on_start(999)
            release.wait(30)
            return original(plan, on_progress=on_progress, timeout_s=timeout_s, **rest)

        server.executor.generate = stuck
        with server.client() as client:
            client.post("/v1/videos", json={"prompt": "x", "size": "128x64", "num_inference_steps": 2})
            wait_until(lambda: client.get("/health").status_code == 503, 5, "/health to report the stall")
            body = client.get("/health").json()
            release.set()
            wait_until(lambda: client.get("/health").status_code == 200, 5, "/health to recover")
    assert body["status"] == "unhealthy" and "no progress" in body["reason"]


def test_the_default_limit_follows_the_long_video_mode():
    """What the long video modes offer at the largest canvas passes by default; the runaway still does not."""
    from h3serve.rules.validate import ModelDefaults

    real = ModelDefaults()
    big = {"prompt": "x", "width": 1792, "height": 1024, "steps": 50, "long_video": True}
    full = validate(GenerationRequest(**big, duration_s=30, long_video_mode="full"), real)
    windows = validate(GenerationRequest(**big, duration_s=300, long_video_mode="continuation"), real)
    assert default_max_cost(real) < request_cost(full) <= default_max_cost(real, "full")
    assert default_max_cost(real, "full") < request_cost(windows) <= default_max_cost(real, "continuation")
    runaway = validate(GenerationRequest(prompt="x", width=4096, height=4096, duration_s=30, steps=200,
                                         long_video=True, long_video_mode="full"), real)
    assert request_cost(runaway) > 30 * default_max_cost(real, "full")
