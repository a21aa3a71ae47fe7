"""Defect 1 (scaled down) and defect 8's protocol-level cases: slow and abusive connections, no key needed."""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

import httpx
import psutil
import pytest
from hostile_servers import closed_by_server, serve

SLOW_CONNECTIONS = 500
# Long enough that all SLOW_CONNECTIONS are accepted before the first one times out, even on a loaded
# host (CI took over a second to open 500): only then must the cap evict, which the test asserts.
HEADER_TIMEOUT_S = 5.0
MAX_CONNECTIONS = 300


def _open(port: int, payload: bytes) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    sock.sendall(payload)
    return sock


@pytest.fixture(scope="module")
def guarded(tmp_path_factory):
    with serve(
        tmp_path_factory.mktemp("slow"),
        header_timeout_s=HEADER_TIMEOUT_S,
        keep_alive_timeout_s=1.0,
        max_connections=MAX_CONNECTIONS,
    ) as running:
        yield running


@pytest.mark.slow
def test_500_incomplete_headers_are_timed_out_evicted_and_health_answers(guarded):
    """Slowloris: each connection sends a request line and one header, never the blank line."""
    rss_before = psutil.Process().memory_info().rss
    socks: list[socket.socket] = []
    start = time.monotonic()
    for _ in range(SLOW_CONNECTIONS):
        socks.append(_open(guarded.port, b"GET /health HTTP/1.1\r\nHost: x\r\n"))
    opened_s = time.monotonic() - start
    assert opened_s < HEADER_TIMEOUT_S, f"opening took {opened_s:.2f} s: the cap was never reached"
    guarded.health_s()  # during: at the cap, the oldest slow connection makes room
    answers = [closed_by_server(s, HEADER_TIMEOUT_S + 10) for s in socks]
    elapsed = time.monotonic() - start
    for s in socks:
        s.close()
    grown_mib = (psutil.Process().memory_info().rss - rss_before) / 2**20
    print(
        f"FIGURE slowloris: {SLOW_CONNECTIONS} connections, all closed after {elapsed:.2f} s, RSS +{grown_mib:.0f} MiB"
    )
    assert all(a is not None for a in answers), "a slow connection was still open after its header timeout"
    timed_out = sum(a.startswith(b"HTTP/1.1 408 ") and b"request_timeout" in a for a in answers)
    evicted = sum(a == b"" for a in answers)  # closed without an answer to make room
    assert evicted >= SLOW_CONNECTIONS - MAX_CONNECTIONS, (timed_out, evicted)
    print(f"FIGURE slowloris: {timed_out} timed out (408), {evicted} evicted at the cap")
    assert timed_out + evicted == SLOW_CONNECTIONS
    assert elapsed < HEADER_TIMEOUT_S + 15
    guarded.health_s()  # after
    assert grown_mib < 200  # the server shares this process


def test_past_the_cap_with_every_connection_busy_the_answer_is_a_json_503(tmp_path):
    with serve(tmp_path, max_connections=10) as small:
        # Each holds a request whose body never comes: busy, so not evictable.
        busy = [
            _open(small.port, b"POST /v1/videos HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n") for _ in range(10)
        ]
        time.sleep(0.3)
        answer = closed_by_server(_open(small.port, b""), 5) or b""
        for s in busy:
            s.close()
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 503") and b"retry-after: 1" in head
    assert json.loads(body)["error"]["code"] == "too_many_connections"


def test_an_idle_keep_alive_connection_is_closed(guarded):
    sock = _open(guarded.port, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    answer = closed_by_server(sock, 5)
    sock.close()
    assert answer is not None and answer.startswith(b"HTTP/1.1 200")


def test_a_job_runs_while_slow_connections_crowd_the_cap(guarded):
    """A job never fails because of the HTTP layer: the cap keeps descriptors free for its files. (Each poll
    opens its own connection: an idle keep-alive one may be evicted at the cap, as HTTP allows.)"""
    with guarded.client() as client:
        job = client.post("/v1/videos", json={"prompt": "x", "size": "128x64", "num_inference_steps": 3}).json()
    socks = [_open(guarded.port, b"GET / HTTP/1.1\r\n") for _ in range(MAX_CONNECTIONS + 20)]
    try:
        deadline = time.monotonic() + 30
        while True:
            status = httpx.get(
                f"{guarded.url}/v1/videos/{job['id']}", headers={"Authorization": "Bearer test-key"}, timeout=5
            ).json()["status"]
            if status in ("completed", "failed") or time.monotonic() > deadline:
                break
            time.sleep(0.05)
    finally:
        for s in socks:
            s.close()
    assert status == "completed"


def test_negative_content_length_gets_the_json_envelope(guarded):
    sock = _open(guarded.port, b"POST /v1/videos HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n")
    answer = closed_by_server(sock, 5) or b""
    sock.close()
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400") and b"application/json" in head
    assert b'"code": "invalid_http_request"' in body


def test_a_flood_of_bad_requests_is_logged_a_few_lines_only(guarded, caplog):
    caplog.set_level("WARNING", logger="h3serve.http")
    for _ in range(200):
        sock = _open(guarded.port, b"BAD\x00 / HTTP/1.1\r\n\r\n")
        closed_by_server(sock, 5)
        sock.close()
    lines = [r for r in caplog.records if r.name == "h3serve.http"]
    assert 1 <= len(lines) <= 10


def test_options_lists_every_method_of_the_path(guarded):
    with guarded.client() as client:
        options = client.options("/v1/videos")
        put = client.put("/v1/videos")
    assert options.status_code == 204
    assert options.headers["allow"] == "GET, OPTIONS, POST"
    assert put.status_code == 405 and put.headers["allow"] == "GET, OPTIONS, POST"
    assert put.json()["error"]["code"] == "method_not_allowed"


def test_no_descriptor_leak(guarded):
    """After all the above, the server process holds about as many descriptors as when it started."""
    fds = len(os.listdir(f"/proc/{os.getpid()}/fd")) if Path("/proc/self/fd").exists() else 0
    assert fds < 200


def test_the_open_files_limit_leaves_room_for_jobs():
    import resource

    from h3serve.api.http_server import RESERVED_FDS, reserve_descriptors

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        fits = reserve_descriptors(10**9)  # more than any hard limit: lowered to what fits
        now, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        assert fits == now - RESERVED_FDS and now >= soft
        assert reserve_descriptors(100) == 100
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
