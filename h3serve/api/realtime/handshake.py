"""Upgrades refused before the app sees them, answered in the JSON error envelope.

uvicorn hands a WebSocket upgrade to the `websockets` library, which checks the handshake itself (the
Sec-WebSocket-Key, -Version and -Protocol headers, the method) and refuses a malformed one with a plain-text 400
that echoes the header, API-key subprotocol included. `EnvelopeWebSocketProtocol` is uvicorn's WebSocket protocol
with those refusals (and uvicorn's own 403 and 500 before an accept) written as every other error of the API is:
`{"error": {"message", "type", "param", "code"}}`, the offending header's value left out. An upgrade request
websockets cannot parse at all (a header line over 8 KiB, a control character) is answered the same way and
closed; uvicorn used to leave such a connection open, unanswered.
"""

from __future__ import annotations

import email.utils
import json
from http import HTTPStatus
from typing import Any

from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol
from websockets.datastructures import Headers
from websockets.http11 import Response
from websockets.server import ServerProtocol

from h3serve.api.error_envelope import envelope
from h3serve.rules.shown import cut

_PREFIX = "Failed to open a WebSocket connection"
_CODES = {HTTPStatus.INTERNAL_SERVER_ERROR: "internal_error", HTTPStatus.FORBIDDEN: "forbidden"}
_MAX_MESSAGE = 160


def refusal_message(status: HTTPStatus, text: str) -> str:
    """websockets' reason, without its prefix and without the header value it quotes (`... at 3 in <value>`)."""
    reason = text.strip().splitlines()[0] if text.strip() else ""
    reason = reason.removeprefix(_PREFIX).lstrip(":. ").rstrip(".")
    if reason.startswith("invalid ") and " in " in reason:
        reason = reason[: reason.index(" in ")]
    return cut(f"the WebSocket handshake was refused: {reason or status.phrase.lower()}", _MAX_MESSAGE)


class EnvelopeServerProtocol(ServerProtocol):
    """websockets' server side of the handshake, rejecting in the JSON envelope."""

    def reject(self, status: HTTPStatus | int, text: str) -> Response:
        status = HTTPStatus(status)
        message = refusal_message(status, text)
        body = json.dumps(envelope(status.value, message, _CODES.get(status, "invalid_websocket_handshake"))).encode()
        headers = Headers([
            ("Date", email.utils.formatdate(usegmt=True)),
            ("Connection", "close"),
            ("Content-Length", str(len(body))),
            ("Content-Type", "application/json"),
        ])
        return Response(status.value, status.phrase, headers, body)


class EnvelopeWebSocketProtocol(WebSocketsSansIOProtocol):
    """uvicorn's WebSocket protocol (what `ws="auto"` picks with websockets installed), with the envelope."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # The same connection state machine, built by uvicorn with its settings; only `reject` differs.
        self.conn.__class__ = EnvelopeServerProtocol

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.handshake_initiated or self.conn.handshake_exc is None or self.transport.is_closing():
            return
        # websockets could not read the upgrade request (a header line over 8 KiB, a control character): it queued
        # its refusal, or only an end of stream, which uvicorn never sends, so the connection used to hang open.
        output = [chunk for chunk in self.conn.data_to_send() if chunk]
        if not output:
            output = [self.conn.reject(HTTPStatus.BAD_REQUEST, f"{_PREFIX}: {self.conn.handshake_exc}").serialize()]
        self.transport.write(b"".join(output))
        self.transport.close()
