"""The outermost ASGI layer: whatever escapes the app still gets the JSON error envelope, never uvicorn's plain text.

The app's own handlers (`errors.py`) answer every `Exception` inside Starlette's `ServerErrorMiddleware`. What
passes them reaches uvicorn, which answers a plain-text `500 Internal Server Error`: a request cancelled by the
server (uvicorn cancels the requests still running `timeout_graceful_shutdown` after a shutdown began), an
exception raised by a handler itself, or an app that returned without answering. Here each becomes JSON:

- cancelled before answering: 503 `shutting_down` (the server is stopping), one warning line;
- an exception, or no answer at all: 500 `internal_error`, logged with its traceback.

Both are handled here, not re-raised: uvicorn would log a second traceback for what is already logged.
A response already started cannot be replaced; its exception goes on to uvicorn, which closes the connection
so that the client sees the body cut short.
"""

from __future__ import annotations

import asyncio
import logging

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from h3serve.api.error_envelope import error_response

log = logging.getLogger("h3serve.api")
SHUTDOWN_RETRY_AFTER_S = 5


class LastResort:
    """Wraps the whole app (middleware included); HTTP only, the lifespan passes through."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        state = {"started": False, "complete": False}

        async def watched_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                state["started"] = True
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                state["complete"] = True
            await send(message)

        where = f"{scope.get('method', '?')} {scope.get('path', '?')}"
        try:
            await self.app(scope, receive, watched_send)
        except asyncio.CancelledError:
            if state["started"]:
                raise
            log.warning("%s: cancelled before it was answered (the server is stopping); answered 503", where)
            await _answer(scope, receive, send, 503, "The server is shutting down; retry later.", "shutting_down",
                          {"Retry-After": str(SHUTDOWN_RETRY_AFTER_S)})
        except Exception as exc:
            if state["complete"]:  # answered by the app's handler, which logged it (errors._unexpected)
                return
            if state["started"]:
                raise
            log.error("%s: unhandled error", where, exc_info=exc)
            await _answer(scope, receive, send, 500, "Internal server error.", "internal_error")
        else:
            if not state["started"]:
                log.error("%s: the app returned without answering", where)
                await _answer(scope, receive, send, 500, "Internal server error.", "internal_error")


async def _answer(scope: Scope, receive: Receive, send: Send, status: int, message: str, code: str,
                  headers: dict[str, str] | None = None) -> None:
    """Send the JSON envelope and close the connection; a client already gone is not an error here."""
    response = error_response(status, message, code, headers={**(headers or {}), "Connection": "close"})
    try:
        await response(scope, receive, send)
    except Exception:  # the connection closed under us: nobody to tell
        log.info("could not send the %d answer: the connection is gone", status, exc_info=True)
