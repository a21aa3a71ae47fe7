"""Defect 6: a /sync job whose client went away, or whose request timed out, is cancelled at once."""

from __future__ import annotations

import json
import socket

from hostile_servers import serve
from waiting import wait_until

LONG_JOB = {"prompt": "x", "size": "128x64", "seconds": "4", "num_inference_steps": 200}


def test_a_sync_job_is_cancelled_when_its_client_disconnects(tmp_path):
    with serve(tmp_path) as server:
        server.executor.step_s = 0.05  # 200 steps: 10 s if nothing cancels it
        body = json.dumps(LONG_JOB).encode()
        sock = socket.create_connection(("127.0.0.1", server.port))
        sock.sendall(
            b"POST /v1/videos/sync HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer test-key\r\n"
            b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        wait_until(lambda: server.executor.plans, 10, "the sync job to start")
        sock.close()
        wait_until(lambda: server.executor.cancelled_at, 3, "the abandoned job to be cancelled")
        step, total = server.executor.cancelled_at[0]
        assert total == 200 and step < 60  # within ~1 s of the disconnect, not at the end
        wait_until(lambda: not server.store.ids(), 3, "the sync job's record to be removed")
        server.health_s()


def test_a_sync_job_past_its_timeout_is_cancelled(tmp_path):
    with serve(tmp_path, sync_timeout_s=0.5) as server:
        server.executor.step_s = 0.05
        with server.client() as client:
            response = client.post("/v1/videos/sync", json=LONG_JOB)
        assert response.status_code == 504 and response.json()["error"]["code"] == "timeout"
        wait_until(lambda: server.executor.cancelled_at, 3, "the timed-out job to be cancelled")
        assert server.executor.cancelled_at[0][0] < 30
        assert not server.store.ids()
        with server.client() as client:  # the engine is free for the next job at once
            job = client.post("/v1/videos", json={**LONG_JOB, "num_inference_steps": 2}).json()
            wait_until(
                lambda: client.get(f"/v1/videos/{job['id']}").json()["status"] == "completed",
                10,
                "the next job to complete",
            )
