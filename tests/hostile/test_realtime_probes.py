"""Issue 54's real-time probes, rerun: numbers too long to format in `session.start`, malformed upgrade headers, a
reader that stops reading. Each ends in its own error code and a clean close, or a JSON answer, never an
`internal_error`, a plain-text page or a connection left hanging."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import socket
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "api" / "realtime"))
from api_servers import API_KEY  # noqa: E402
from realtime_servers import serve_realtime  # noqa: E402
from websockets.sync.client import connect  # noqa: E402

from h3serve.api.realtime.session import ClientGone, RealtimeSession  # noqa: E402
from h3serve.api.server_config import ServerConfig  # noqa: E402

SESSION = {"type": "session.start", "format": "m4s", "prompt": "a lighthouse", "width": 64, "height": 64}
HUGE = 10**4299  # 4,300 digits: the longest integer Python's JSON parser reads


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with serve_realtime(tmp_path_factory.mktemp("realtime")) as running:
        yield running


# Each: the session.start, the error code, the close code. The first is the audit's: 4,300 digits of seconds ended
# the session as internal_error (1011) with a traceback, while the integer check formatted the number.
HOSTILE_STARTS = {
    "4,300-digit seconds": ({**SESSION, "seconds": HUGE}, "invalid_message", 1008),
    "seconds past a session's ten minutes": ({**SESSION, "seconds": 999_999}, "invalid_request", 1008),
    "a 4,300-digit seed": ({**SESSION, "seed": HUGE}, "invalid_message", 1008),
    "a 4,300-digit frame count in video_params": ({**SESSION, "video_params": {"num_frames": HUGE}},
                                                   "invalid_message", 1008),
    "a 4,300-digit fps in extra_params": ({**SESSION, "extra_params": {"fps": HUGE}}, "invalid_request", 1008),
    "a 4,300-digit n in sampling_params": ({**SESSION, "sampling_params": {"n": HUGE}}, "invalid_request", 1008),
}


@pytest.mark.parametrize("case", list(HOSTILE_STARTS))
def test_unbounded_numbers_in_session_start_end_in_their_own_code(server, case):
    start, code, close_code = HOSTILE_STARTS[case]
    with connect(server.ws_url, additional_headers={"Authorization": f"Bearer {API_KEY}"}, open_timeout=10) as ws:
        ws.send(json.dumps(start))
        error = json.loads(ws.recv(10))
        assert error["type"] == "error" and error["code"] == code, error
        assert len(error["message"]) < 300 and "Traceback" not in error["message"]
        with pytest.raises(Exception):  # noqa: B017 - the server closes; recv raises ConnectionClosed
            ws.recv(10)
        assert ws.close_code == close_code
    assert not [line for line in server.errors if "Traceback" in line or "Exception in ASGI" in line]


def _upgrade(server, protocol: bytes) -> bytes:
    """A raw upgrade request with `protocol` as its Sec-WebSocket-Protocol; what the server answered (b"" if it
    closed silently), or TimeoutError if it kept the connection open without answering."""
    port = int(server.url.rsplit(":", 1)[1])
    key = base64.b64encode(os.urandom(16))
    request = (b"GET /v1/realtime/video HTTP/1.1\r\nHost: test\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
               b"Sec-WebSocket-Key: " + key + b"\r\nSec-WebSocket-Version: 13\r\nAuthorization: Bearer "
               + API_KEY.encode() + b"\r\nSec-WebSocket-Protocol: " + protocol + b"\r\n\r\n")
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(request)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    return answer


@pytest.mark.parametrize("protocol", [b"a b", b",,,", b"\xc3\xa9", b"openai-insecure-api-key." + API_KEY.encode()
                                      + b", a;b", b"\x01", b"a" * 9000])
def test_a_refused_upgrade_is_answered_in_the_json_envelope(server, protocol):
    """A malformed Sec-WebSocket-Protocol got websockets' text/plain 400 (echoing the header, API key included);
    a control character or a header line over 8 KiB got no answer at all and the connection stayed open."""
    head, _, body = _upgrade(server, protocol).partition(b"\r\n\r\n")
    assert head.startswith((b"HTTP/1.1 400 ", b"HTTP/1.1 431 ")), head
    assert b"content-type: application/json" in head.lower()
    error = json.loads(body)["error"]
    assert error["code"] == "invalid_websocket_handshake" and "refused" in error["message"]
    assert API_KEY not in error["message"] and "a;b" not in error["message"]


def test_a_send_to_a_stalled_reader_gives_up_when_the_stall_clock_runs_out():
    """The audit's stalled reader held its replica ~90 s where the docs say 60: each send waited the whole stall
    timeout, however long the session had already gone without progress. Now a send gets what is left of it."""

    class Stalled:  # a socket whose client reads nothing: every send waits forever
        async def send_text(self, text: str) -> None:
            await asyncio.Event().wait()

    config = ServerConfig(served_model_name="tiny", data_dir=Path("/nonexistent"), realtime_stall_timeout_s=60.0)
    session = RealtimeSession(Stalled(), lease=None, config=config, metrics=None)  # type: ignore[arg-type]
    session.last_progress = time.monotonic() - 59.7  # the engine took most of the stall timeout already

    async def run() -> None:
        await asyncio.wait_for(session._transmit(session.ws.send_text("chunk")), timeout=10)

    with pytest.raises(ClientGone):  # before: the send waited 60 s more (the outer 10 s ran out first)
        asyncio.run(run())
