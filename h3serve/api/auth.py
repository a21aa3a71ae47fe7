"""`--api-key`: a Bearer token check that every /v1 route depends on."""

from __future__ import annotations

import hmac
from collections.abc import Callable

from fastapi import Request

from h3serve.api.error_envelope import APIError


def bearer_auth(api_key: str | None) -> Callable[[Request], None]:
    """A FastAPI dependency: 401 unless `Authorization: Bearer <api_key>` (a no-op when `api_key` is None)."""
    expected = None if api_key is None else api_key.encode()

    def check(request: Request) -> None:
        if expected is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), expected):
            raise APIError(
                401,
                "Incorrect or missing API key: send 'Authorization: Bearer <key>'.",
                "invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )

    return check
