"""Issue 20: request bodies that stall inside their declared length are answered 408 and closed within
`--body-timeout` (+ a margin) while /health stays fast; a slow but steady upload still succeeds."""

from __future__ import annotations

import io
import json
import socket
import time

import httpx
import numpy as np
import pytest
from api_servers import API_KEY
from hostile_servers import closed_by_server, serve
from PIL import Image
from prometheus_client.parser import text_string_to_metric_families

from h3serve.api.body_timeout import MIN_BODY_RATE, body_deadline_s

STALLED = 200
BODY_TIMEOUT_S = 2.0
MARGIN_S = 4.0
HEAD = (
    "POST /v1/videos HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n"
    "Content-Type: multipart/form-data; boundary=b\r\nContent-Length: {length}\r\n\r\n"
)


@pytest.fixture(scope="module")
def guarded(tmp_path_factory):
    with serve(tmp_path_factory.mktemp("bodies"), body_timeout_s=BODY_TIMEOUT_S) as running:
        yield running


def test_stalled_bodies_are_closed_within_the_body_timeout_and_health_stays_fast(guarded):
    socks = []
    for _ in range(STALLED):
        sock = socket.create_connection(("127.0.0.1", guarded.port), timeout=5)
        sock.sendall(HEAD.format(key=API_KEY, length=100_000).encode() + b"--b\r\nContent-Disposition: form")
        socks.append(sock)
    opened = time.monotonic()
    time.sleep(BODY_TIMEOUT_S / 3)  # past the burst of 250 requests starting (a loaded 2-core host is slow to it)
    health = [guarded.health_s() for _ in range(3)]  # during the stall: the stalled bodies hold no thread
    answers = [closed_by_server(s, BODY_TIMEOUT_S + MARGIN_S) for s in socks]
    closed_after = time.monotonic() - opened
    for s in socks:
        s.close()
    health.append(guarded.health_s())
    print(f"FIGURE stalled bodies: {STALLED} closed {closed_after:.2f} s after the last was opened "
          f"(--body-timeout {BODY_TIMEOUT_S:g}); /health {[round(h * 1000) for h in health]} ms")
    assert all(a is not None for a in answers), "a stalled body was still open after --body-timeout + margin"
    timed_out = [a for a in answers if a.startswith(b"HTTP/1.1 408 ")]
    assert len(timed_out) == STALLED, answers[0][:300]
    assert json.loads(timed_out[0].partition(b"\r\n\r\n")[2])["error"]["code"] == "request_timeout"
    assert closed_after < BODY_TIMEOUT_S + MARGIN_S
    metrics = httpx.get(f"{guarded.url}/metrics", timeout=5).text
    counted = {s.labels["phase"]: s.value for f in text_string_to_metric_families(metrics) for s in f.samples
               if s.name == "h3serve_request_timeouts_total"}
    assert counted["body"] == STALLED


def _noise_png(edge: int) -> bytes:
    pixels = np.random.default_rng(0).integers(0, 256, (edge, edge, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def test_a_slow_but_steady_upload_of_a_large_reference_succeeds(guarded):
    image = _noise_png(512)  # ~790 KB
    body = (
        b'--b\r\nContent-Disposition: form-data; name="prompt"\r\n\r\na slow upload\r\n'
        b'--b\r\nContent-Disposition: form-data; name="input_reference"; filename="k.png"\r\n'
        b"Content-Type: image/png\r\n\r\n" + image + b"\r\n--b--\r\n"
    )
    rate = 2 * MIN_BODY_RATE  # steady, above the rate the deadline allows for
    chunk = rate // 4
    assert len(body) / rate > 2 * BODY_TIMEOUT_S  # it takes longer than the idle timeout ...
    assert len(body) / rate < body_deadline_s(BODY_TIMEOUT_S, len(body))  # ... and fits the overall deadline
    sock = socket.create_connection(("127.0.0.1", guarded.port), timeout=30)
    start = time.monotonic()
    sock.sendall(HEAD.format(key=API_KEY, length=len(body)).encode())
    for offset in range(0, len(body), chunk):
        sock.sendall(body[offset : offset + chunk])
        time.sleep(0.25)
    sock.shutdown(socket.SHUT_WR)
    answer = closed_by_server(sock, 30) or b""
    sock.close()
    took = time.monotonic() - start
    assert answer.startswith(b"HTTP/1.1 200 "), answer[:300]
    job = json.loads(answer.partition(b"\r\n\r\n")[2])
    assert job["status"] == "queued" and took > 2 * BODY_TIMEOUT_S


def test_a_trickling_body_meets_the_overall_deadline(guarded):
    """One byte every 0.5 s never trips the idle timeout; the deadline for its 10 kB (2 s + 0.15 s) does."""
    sock = socket.create_connection(("127.0.0.1", guarded.port), timeout=5)
    start = time.monotonic()  # before the head goes: the server may start its clock before sendall returns here
    sock.sendall(HEAD.format(key=API_KEY, length=10_000).encode()
                 + b'--b\r\nContent-Disposition: form-data; name="prompt"\r\n\r\n')
    sock.settimeout(0.5)
    answer = b""
    while time.monotonic() - start < BODY_TIMEOUT_S + MARGIN_S:
        try:
            chunk = sock.recv(4096)
        except TimeoutError:  # nothing yet: one more letter of the prompt
            try:
                sock.sendall(b"x")
            except (BrokenPipeError, ConnectionResetError):  # closed meanwhile: read what it sent
                pass
            continue
        except ConnectionResetError:
            break
        if not chunk:
            break
        answer += chunk
    took = time.monotonic() - start
    sock.close()
    assert answer.startswith(b"HTTP/1.1 408 ") and b"did not arrive in full within 2.2 s" in answer, answer[:300]
    assert body_deadline_s(BODY_TIMEOUT_S, 10_000) <= took < BODY_TIMEOUT_S + MARGIN_S
