"""Reading a client's WebSocket messages into the typed messages (messages.py), or a `ProtocolError` that says in one
line what was wrong: the session answers it with an `error` message and closes cleanly.

Every message is one JSON object in a text frame: `session.start` of at most 4 MiB, any later one of at most
128 KiB (vLLM-Omni's limits, h3serve.rules.limits). Unknown fields are refused by name, as on /v1/videos.
"""

from __future__ import annotations

from typing import Any

from pydantic import TypeAdapter, ValidationError

from h3serve.api.intake.json_values import parse_json, preview
from h3serve.api.realtime.events import CONTROL_TYPES, ControlMessage, SessionStart
from h3serve.errors import ClientError
from h3serve.rules import limits

# WebSocket close codes (RFC 6455 7.4.1)
NORMAL, GOING_AWAY, UNSUPPORTED_DATA, POLICY, TOO_BIG, INTERNAL, RESTART, TRY_LATER = (
    1000, 1001, 1003, 1008, 1009, 1011, 1012, 1013)  # fmt: skip

_CONTROL = TypeAdapter(ControlMessage)


class ProtocolError(ClientError):
    """A message the protocol does not allow: `code` (per instance) for the `error` message, `close_code` for the
    close."""

    def __init__(self, code: str, message: str, close_code: int = POLICY):
        super().__init__(message)
        self.code, self.message, self.close_code = code, message, close_code


def parse_start(frame: dict[str, Any]) -> SessionStart:
    """The first message, which must be `session.start`."""
    message = _json_object(frame, limits.REALTIME_START_MESSAGE_BYTES, "session.start")
    if message.get("type") != "session.start":
        raise ProtocolError("expected_session_start",
                            f"the first message must be session.start, got type {preview(message.get('type'))}")
    try:
        return SessionStart.model_validate(SessionStart.fold(message))
    except ValidationError as e:
        raise ProtocolError("invalid_message", f"session.start: {_first_error(e)}") from None


def parse_control(frame: dict[str, Any]) -> ControlMessage:
    """A message after `session.start`: `session.interaction`, `session.ping` or `session.stop`."""
    message = _json_object(frame, limits.REALTIME_CONTROL_MESSAGE_BYTES, "a control message")
    kind = message.get("type")
    if kind not in CONTROL_TYPES:
        expected = ", ".join(CONTROL_TYPES)
        raise ProtocolError("unknown_type", f"unknown message type {preview(kind)}; expected one of {expected}")
    try:
        return _CONTROL.validate_python(message)
    except ValidationError as e:
        raise ProtocolError("invalid_message", f"{kind}: {_first_error(e)}") from None


def _json_object(frame: dict[str, Any], limit: int, what: str) -> dict[str, Any]:
    """The JSON object of a `websocket.receive` frame of at most `limit` bytes."""
    text = frame.get("text")
    if text is None:
        raise ProtocolError("binary_not_supported", "messages are JSON text frames; binary frames are not accepted",
                            UNSUPPORTED_DATA)
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > limit:
        raise ProtocolError("message_too_large", f"{what} is {size} bytes; at most {limit} are accepted", TOO_BIG)
    try:
        message = parse_json(text)
    except ValueError as e:
        raise ProtocolError("invalid_json", f"{what} is not valid JSON: {e}") from None
    if not isinstance(message, dict):
        raise ProtocolError("invalid_message", f"{what} must be a JSON object, got {type(message).__name__}")
    return message


def _first_error(e: ValidationError) -> str:
    """'field.path: what is wrong, got value' for the first error pydantic reports."""
    error = e.errors()[0]
    where = ".".join(str(part) for part in error["loc"] if not _is_union_tag(part)) or "message"
    if error["type"] == "extra_forbidden":
        return f"{where}: unknown field"
    if error["type"] == "missing":
        return f"{where}: is required"
    return f"{where}: {error['msg'][0].lower()}{error['msg'][1:]}, got {preview(error.get('input'))}"


def _is_union_tag(part: Any) -> bool:
    """pydantic names union members and discriminator values in error locations: not field names."""
    return isinstance(part, str) and ("[" in part or part in CONTROL_TYPES or part in ("int", "str"))
