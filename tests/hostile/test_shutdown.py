"""Defect 7: SIGTERM during a /sync request: a JSON 503 `shutting_down`, a clean exit, nothing left in /tmp."""

from __future__ import annotations

import shutil
import signal
import tempfile
import threading
import time
from pathlib import Path

import httpx
import pytest
from api_servers import start_live_server

KEY = "sk-test"
GRACE_S = 1.0


@pytest.fixture
def spool_tmp():
    """The server's TMPDIR: its spool folder must be gone after the exit. A short path directly under the system's
    temp dir: the rank fork server's AF_UNIX socket goes in it (at most 107 bytes; a pytest-xdist worker's tmp_path
    is too deep)."""
    path = Path(tempfile.mkdtemp(prefix="h3-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.slow
def test_sigterm_during_a_sync_request_drains_and_cleans_up(tiny_checkpoint, tmp_path, spool_tmp):
    server = start_live_server(
        tiny_checkpoint,
        tmp_path / "data",
        "--api-key",
        KEY,
        "--shutdown-grace",
        str(GRACE_S),
        "--max-request-cost",  # the job must outlast the grace: a long one, allowed here
        "1e6",
        env={"TMPDIR": str(spool_tmp)},
    )
    try:
        # Beside the spool folder: multiprocessing's own (`pymp-*`, the rank fork server's socket), if any.
        assert [p.name for p in spool_tmp.iterdir() if not p.name.startswith("pymp-")][0].startswith("h3serve-spool-")
        answer: dict[str, httpx.Response] = {}

        def sync_request() -> None:
            with httpx.Client(timeout=60, headers={"Authorization": f"Bearer {KEY}"}) as client:
                answer["sync"] = client.post(
                    f"{server.url}/v1/videos/sync",
                    json={"prompt": "x", "size": "128x64", "seconds": "15", "num_inference_steps": 200},
                )

        thread = threading.Thread(target=sync_request)
        thread.start()
        time.sleep(3.0)  # the job is running on the ranks
        signalled = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        thread.join(30)
        answered_s = time.monotonic() - signalled
        code = server.proc.wait(30)
        exited_s = time.monotonic() - signalled
    finally:
        server.stop()
    print(f"FIGURE sigterm: 503 after {answered_s:.2f} s, exit {code} after {exited_s:.2f} s")
    response = answer["sync"]
    assert response.status_code == 503, response.text
    assert response.headers["content-type"] == "application/json"
    assert response.json()["error"]["code"] == "shutting_down"
    assert answered_s < GRACE_S + 5, answered_s
    assert code == 0 and exited_s < 30, (code, exited_s)
    assert list(spool_tmp.iterdir()) == []  # the server's own clean-up ran
    assert "Traceback" not in server.log()
