"""`--api-key`: a Bearer token check that every /v1 route depends on, and the same check at a WebSocket's upgrade."""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable

from fastapi import Request
from starlette.requests import HTTPConnection

from h3serve.api.error_envelope import APIError

# A browser's WebSocket cannot set headers: it may offer the key as a subprotocol instead (OpenAI's Realtime API
# convention), beside a plain one the server selects.
KEY_SUBPROTOCOL = "openai-insecure-api-key."
MISSING_KEY = "Incorrect or missing API key: send 'Authorization: Bearer <key>'."


def bearer_auth(api_key: str | None) -> Callable[[Request], None]:
    """A FastAPI dependency: 401 unless `Authorization: Bearer <api_key>` (a no-op when `api_key` is None)."""

    def check(request: Request) -> None:
        if not authorized(request, api_key, subprotocols=False):
            raise APIError(401, MISSING_KEY, "invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    return check


def authorized(connection: HTTPConnection, api_key: str | None, *, subprotocols: bool) -> bool:
    """Whether `connection` carries `api_key` (always, when None): as `Authorization: Bearer <key>`, or for a
    WebSocket (`subprotocols`) as an offered subprotocol `openai-insecure-api-key.<key>`."""
    if api_key is None:
        return True
    expected = api_key.encode()
    scheme, _, token = connection.headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), expected):
        return True
    offered = connection.headers.get("sec-websocket-protocol", "") if subprotocols else ""
    keys = [p.strip()[len(KEY_SUBPROTOCOL):] for p in offered.split(",") if p.strip().startswith(KEY_SUBPROTOCOL)]
    return any(hmac.compare_digest(key.encode(), expected) for key in keys)


def key_scope(api_key: str | None) -> str:
    """The API key a request came with, as stored beside what it made (webhook endpoints, and the jobs whose events
    they receive): a digest, never the key itself; "" when keys are off. A server checks one key, so the scope of
    every request it authorised is its key's."""
    if api_key is None:
        return ""
    return hashlib.sha256(b"h3serve key scope\0" + api_key.encode()).hexdigest()[:32]
