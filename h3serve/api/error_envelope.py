"""The OpenAI error envelope `{"error": {"message", "type", "param", "code"}}` for every failure.

Handlers turn every exception into that envelope with the right status; an unexpected exception is logged
with its traceback and answered with a generic 500, so no stack trace or server path reaches a client.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from http import HTTPStatus
from typing import TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.routing import Match

from h3serve.errors import H3ServeError
from h3serve.jobstore.store_errors import StoreClosed, StoreUnavailable
from h3serve.output_store.interface import OutputMissing, OutputStoreUnavailable
from h3serve.rules.shown import shown
from h3serve.rules.validate import RequestError

E = TypeVar("E", bound=Exception)
Handler = Callable[[Request, Exception], Awaitable[Response]]

log = logging.getLogger("h3serve.api")

_TYPES = {
    401: "authentication_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
    504: "timeout_error",
}


class APIError(H3ServeError):
    """An HTTP error with the OpenAI envelope. `headers` go on the response (e.g. Retry-After). A 4xx is the
    client's error, a 5xx the server's; the message is written for the client."""

    client_safe = True

    def __init__(
        self,
        status: int,
        message: str,
        code: str,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.kind = "client" if status < 500 else "server"
        self.param = param
        self.headers = headers or {}


def bad_request(message: str, param: str | None = None, code: str = "invalid_value") -> APIError:
    return APIError(400, message, code, param)


def from_request_error(err: RequestError, aliases: dict[str, str] | None = None) -> APIError:
    """A validation error as a 400 naming the field as the client sent it (`steps` -> `num_inference_steps`)."""
    param = (aliases or {}).get(err.field, err.field)
    return APIError(400, f"{param}: {err.message}", "invalid_value", param)


MAX_ID_SHOWN = 64  # a job id is 38 characters


def not_found(video_id: str) -> APIError:
    """404 for an unknown id; the id is echoed cut to a job id's length (a client's 60 KB id is not sent back)."""
    return APIError(404, f"Video with id {shown(video_id, MAX_ID_SHOWN)} not found.", "video_not_found", "video_id")


def envelope(status: int, message: str, code: str, param: str | None = None) -> dict[str, dict[str, str | None]]:
    """The body of every error answer."""
    return {"error": {"message": message, "type": _TYPES.get(status, "invalid_request_error"), "param": param,
                      "code": code}}


def error_response(status: int, message: str, code: str, param: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(envelope(status, message, code, param), status_code=status, headers=headers)


async def _api_error(_: Request, exc: APIError) -> JSONResponse:
    return error_response(exc.status, exc.message, exc.code, exc.param, exc.headers)


_METHODS = ("DELETE", "GET", "HEAD", "PATCH", "POST", "PUT")
# /v1/videos/<literal> routes (POST only): these segments are never a video id, so the {video_id} routes do not
# serve them.
RESERVED_VIDEO_SEGMENTS = frozenset({"sync", "edits", "extensions"})


def reserved_video_path(path: str) -> bool:
    """`/v1/videos/sync` (or edits, extensions): a literal route's path, not a video's."""
    parts = path.rstrip("/").split("/")
    return len(parts) == 4 and parts[1:3] == ["v1", "videos"] and parts[3] in RESERVED_VIDEO_SEGMENTS


def allowed_methods(request: Request) -> list[str]:
    """Every method some route serves on this path (Starlette's 405 names only the first matching route's); a
    literal route's path (`/v1/videos/sync`, `/edits`, `/extensions`: POST only) is not a {video_id}'s."""
    if reserved_video_path(request.url.path):
        return ["OPTIONS", "POST"]
    served = {
        method
        for method in _METHODS
        if any(route.matches({**request.scope, "method": method})[0] == Match.FULL for route in request.app.routes)
    }
    return sorted(served | {"OPTIONS"})


async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
    headers = dict(getattr(exc, "headers", None) or {})
    if exc.status_code == 405:
        headers["Allow"] = ", ".join(allowed_methods(request))
        if request.method == "OPTIONS":  # what OPTIONS is for: which methods this path takes
            return Response(status_code=204, headers=headers)
    phrase = HTTPStatus(exc.status_code).phrase
    message = exc.detail if isinstance(exc.detail, str) else phrase
    code = phrase.lower().replace(" ", "_").replace("-", "_")
    return error_response(exc.status_code, message, code, headers=headers)


async def _client_gone(request: Request, _: ClientDisconnect) -> JSONResponse:
    # Routine (a closed tab, a killed curl), not a server fault: one line, no traceback. Nobody reads the answer.
    log.info("%s %s: the client disconnected before its request was read", request.method, request.url.path)
    return error_response(400, "The client disconnected.", "client_disconnected")


async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
    first = exc.errors()[0] if exc.errors() else {}
    location = [str(part) for part in first.get("loc", ()) if part not in ("query", "path", "body")]
    param = ".".join(location) or None
    # A validator's own words, without pydantic's "Value error, " in front of them.
    detail = str(first.get("msg", "invalid value" if param else "invalid request")).removeprefix("Value error, ")
    message = f"{param}: {detail}" if param else detail
    return error_response(400, message, "invalid_value", param)


STORE_RETRY_AFTER_S = 5


async def _store_unavailable(request: Request, exc: StoreUnavailable) -> JSONResponse:
    # The database is away (restarting, unreachable): the server's condition, not the request's; retry later.
    log.warning("%s %s: %s", request.method, request.url.path, exc)
    return error_response(503, "The job database is unreachable right now; retry shortly.", "store_unavailable",
                          headers={"Retry-After": str(STORE_RETRY_AFTER_S)})


async def _store_closed(request: Request, exc: StoreClosed) -> JSONResponse:
    # A request the shutdown stopped waiting for, reaching the store after it closed: the server is going away.
    log.warning("%s %s: %s", request.method, request.url.path, exc)
    return error_response(503, "The server is shutting down; retry later.", "shutting_down",
                          headers={"Retry-After": str(STORE_RETRY_AFTER_S)})


async def _output_store_unavailable(request: Request, exc: OutputStoreUnavailable) -> JSONResponse:
    # The bucket is away: the operator's log names it; the client learns what failed and to retry.
    log.warning("%s %s: %s", request.method, request.url.path, exc)
    return error_response(503, f"The output store is unreachable right now ({exc.reason}); retry shortly.",
                          "output_store_unavailable", headers={"Retry-After": str(STORE_RETRY_AFTER_S)})


async def _output_missing(request: Request, exc: OutputMissing) -> JSONResponse:
    # The record says the job completed, yet its object is gone (removed outside h3serve): a 404 saying so.
    log.warning("%s %s: %s", request.method, request.url.path, exc)
    return error_response(404, "The video's file is missing from the output store (removed outside the server).",
                          "file_not_found")


async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
    log.error("unhandled error", exc_info=exc)
    return error_response(500, "Internal server error.", "internal_error")


def _for(kind: type[E], handle: Callable[[Request, E], Awaitable[Response]]) -> Handler:
    """`handle` as Starlette registers it (any exception): it only ever receives a `kind`."""

    async def handler(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, kind)
        return await handle(request, exc)

    return handler


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(APIError, _for(APIError, _api_error))
    app.add_exception_handler(StarletteHTTPException, _for(StarletteHTTPException, _http_error))
    app.add_exception_handler(ClientDisconnect, _for(ClientDisconnect, _client_gone))
    app.add_exception_handler(RequestValidationError, _for(RequestValidationError, _validation_error))
    app.add_exception_handler(StoreUnavailable, _for(StoreUnavailable, _store_unavailable))
    app.add_exception_handler(StoreClosed, _for(StoreClosed, _store_closed))
    app.add_exception_handler(OutputStoreUnavailable, _for(OutputStoreUnavailable, _output_store_unavailable))
    app.add_exception_handler(OutputMissing, _for(OutputMissing, _output_missing))
    app.add_exception_handler(Exception, _unexpected)
