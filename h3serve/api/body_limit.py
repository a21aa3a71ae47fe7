"""An ASGI middleware that caps the size of every request body (413).

A declared Content-Length over the cap is refused before a byte of the body is read (so a client waiting on
`Expect: 100-continue` never uploads it); a chunked body is counted as it streams and refused once over.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from h3serve.api.error_envelope import APIError, error_response


def _too_large(limit: int) -> APIError:
    return APIError(413, f"The request body exceeds the {limit // 2**20} MiB limit.", "request_too_large")


class BodySizeLimit:
    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_bytes):
            err = _too_large(self.max_bytes) if declared.isdigit() else APIError(
                400, "Invalid Content-Length header.", "invalid_request"
            )
            await error_response(err.status, err.message, err.code)(scope, receive, send)
            return

        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise _too_large(self.max_bytes)  # the error handlers answer 413
            return message

        await self.app(scope, limited_receive, send)
