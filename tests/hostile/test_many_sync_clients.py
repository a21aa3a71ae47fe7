"""Issue 20: vLLM-Omni's concurrency test (1, 8, 16, 32 simultaneous POST /v1/videos/sync, every one must
complete) on the default flags (--max-queue 16, --sync-timeout 600), and the 429 kept for real overflow.
The figures on the tiny checkpoint are in docs/reliability.md."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from api_servers import API_KEY
from fake_executor import FakeExecutor
from hostile_servers import serve

from h3serve.api.server_config import ServerConfig

DEFAULTS = ServerConfig(served_model_name="tiny")
FORM = {"prompt": "a fox", "seconds": "4", "size": "32x32", "num_inference_steps": "3"}


def _sync(url: str, timeout_s: float = DEFAULTS.sync_timeout_s + 30) -> tuple[int, float]:
    start = time.monotonic()
    response = httpx.post(f"{url}/v1/videos/sync", data=FORM, headers={"Authorization": f"Bearer {API_KEY}"},
                          timeout=timeout_s)
    return response.status_code, time.monotonic() - start


@pytest.mark.parametrize("clients, max_queue", [
    (4, 2),  # 2 queued + 2 in line, as 32 is 16 + 16 on the defaults (a fake job takes ~0.5 s here)
    pytest.param(32, DEFAULTS.max_queue, marks=pytest.mark.slow),  # the default flags themselves
])
def test_simultaneous_sync_requests_all_complete(tmp_path, clients, max_queue):
    with serve(tmp_path, executor=FakeExecutor(step_s=0.1), max_queue=max_queue,
               sync_timeout_s=DEFAULTS.sync_timeout_s) as server:
        start = time.monotonic()
        with ThreadPoolExecutor(clients) as pool:
            results = list(pool.map(lambda _: _sync(server.url), range(clients)))
        wall = time.monotonic() - start
        line = server.app.state.context.sync_line
    statuses = [status for status, _ in results]
    latencies = sorted(took for _, took in results)
    print(f"FIGURE {clients} sync clients, --max-queue {max_queue} (fake engine): wall {wall:.1f} s, latency p50 "
          f"{latencies[len(latencies) // 2]:.1f} s, max {latencies[-1]:.1f} s; {line.peak} waited for a slot")
    assert statuses == [200] * clients  # before: 1 running + max_queue queued completed, the rest got 429
    assert line.peak >= max(1, clients - 1 - 2 * max_queue)  # the queue did fill: the line was used


class GatedExecutor(FakeExecutor):
    """Every job waits for the gate before its first step: until the test opens it, nothing leaves the queue or
    the line, however busy the host (a timing-based version failed under a loaded suite)."""

    def __init__(self):
        super().__init__(step_s=0.01)
        self.gate = threading.Event()
        self.entered = threading.Event()  # a job reached the engine (the queue no longer holds it)

    def generate(self, plan, *args, **kwargs):
        self.entered.set()
        self.gate.wait(60)
        return super().generate(plan, *args, **kwargs)


def test_the_queue_still_answers_429_for_real_overflow(tmp_path):
    """--max-queue 2: at most 2 sync requests wait in line for a slot; beyond them, and for an async job, the
    answer is 429 at once. Once the engine moves, every request in the line completes."""
    executor = GatedExecutor()
    with serve(tmp_path, executor=executor, max_queue=2, sync_timeout_s=60.0) as server, server.client() as client:
        line = server.app.state.context.sync_line
        try:
            with ThreadPoolExecutor(5) as pool:
                # 1 running (claimed first: a claim made after the others queued would let one of the line in),
                # then 2 queued and 2 in line.
                sync = [pool.submit(_sync, server.url, 90)]
                assert executor.entered.wait(30)
                sync += [pool.submit(_sync, server.url, 90) for _ in range(4)]
                deadline = time.monotonic() + 30
                while line.length < 2 and time.monotonic() < deadline:
                    time.sleep(0.02)
                assert line.length == 2
                overflow = client.post("/v1/videos/sync", data=FORM)
                async_job = client.post("/v1/videos", data=FORM)
                executor.gate.set()
                statuses = [f.result()[0] for f in sync]
        finally:
            executor.gate.set()
    assert overflow.status_code == 429 and overflow.json()["error"]["code"] == "queue_full", overflow.text
    assert "retry-after" in overflow.headers
    assert async_job.status_code == 429
    assert statuses == [200] * 5, statuses
