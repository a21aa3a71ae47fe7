"""No path answers uvicorn's plain-text 500: what escapes the app's handlers still gets the JSON envelope.

Routes that fail in the ways the handlers cannot catch are added to the real app (`create_app`) served by
uvicorn; before `LastResort`, each of the last three got `text/plain` "Internal Server Error".
"""

from __future__ import annotations

import asyncio
import logging

import httpx
import pytest
from fastapi.responses import StreamingResponse
from hostile_servers import HostileServer, uvicorn_errors
from starlette.types import Receive, Scope, Send


class Boom(Exception):
    pass


async def raises() -> None:
    raise Boom("a bug in a route")


async def cancelled() -> None:
    raise asyncio.CancelledError("the server cancelled this request")  # what uvicorn's shutdown timeout does


async def silent(scope: Scope, receive: Receive, send: Send) -> None:
    """A raw ASGI app that never answers."""


async def breaks_mid_body() -> StreamingResponse:
    async def chunks():
        yield b"first part"
        raise Boom("the body broke after it started")

    return StreamingResponse(chunks(), media_type="application/octet-stream")


@pytest.fixture(scope="module")
def routes(server: HostileServer) -> str:
    server.app.add_api_route("/test/raises", raises)
    server.app.add_api_route("/test/cancelled", cancelled)
    server.app.add_api_route("/test/breaks", breaks_mid_body)
    server.app.mount("/test/silent", silent)
    return server.url


def json_error(response: httpx.Response, status: int, code: str) -> None:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    assert response.json()["error"]["code"] == code


def test_a_route_that_raises_is_a_json_500_logged_once(routes, caplog):
    with caplog.at_level(logging.ERROR, logger="h3serve.api"):
        response = httpx.get(f"{routes}/test/raises", timeout=10)
    json_error(response, 500, "internal_error")
    assert "a bug in a route" not in response.text  # no exception text reaches the client
    logged = [r for r in caplog.records if r.exc_info and isinstance(r.exc_info[1], Boom)]
    assert len(logged) == 1


def test_a_request_cancelled_before_its_answer_is_a_json_503(routes):
    with uvicorn_errors() as errors:  # uvicorn would log before answering: checked once the answer is in
        response = httpx.get(f"{routes}/test/cancelled", timeout=10)
    json_error(response, 503, "shutting_down")
    assert response.headers["retry-after"] == "5" and errors == []


def test_an_app_that_never_answers_is_a_json_500(routes):
    response = httpx.get(f"{routes}/test/silent/", timeout=10)
    json_error(response, 500, "internal_error")


def test_a_body_that_breaks_after_it_started_is_cut_not_patched(routes, server):
    """Nothing can replace a response already started: the connection closes and the client sees it cut."""
    with pytest.raises(httpx.RemoteProtocolError):
        httpx.get(f"{routes}/test/breaks", timeout=10)
    server.health_s()  # the server goes on
