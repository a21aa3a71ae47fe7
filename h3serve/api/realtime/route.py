"""`WS /v1/realtime/video`: vLLM-Omni's real-time video session (protocol in messages.py, the session in session.py).

Before the upgrade: the API key (a Bearer header, or the browser's key subprotocol) and a free replica, else an HTTP
answer in the error envelope: 401, or 429 with Retry-After while every replica runs a job or a session (503 while
the server shuts down). After it: a server without --realtime-lora says so in an `error` message and closes.
"""

from __future__ import annotations

from fastapi import APIRouter
from starlette.websockets import WebSocket

from h3serve.api.auth import KEY_SUBPROTOCOL, MISSING_KEY, authorized
from h3serve.api.context import ServerContext
from h3serve.api.error_envelope import error_response
from h3serve.api.realtime.events import ErrorMessage
from h3serve.api.realtime.parse import POLICY, TRY_LATER
from h3serve.api.realtime.session import RealtimeSession
from h3serve.engine.jobs.types import ShuttingDown
from h3serve.engine.realtime_stream import RealtimeBusy, RealtimeUnavailable

router = APIRouter()
PATH = "/v1/realtime/video"


@router.websocket(PATH)
async def realtime_video(websocket: WebSocket) -> None:
    context: ServerContext = websocket.app.state.context
    config = context.config
    if not authorized(websocket, config.api_key, subprotocols=True):
        await _deny(websocket, 401, MISSING_KEY, "invalid_api_key", {"WWW-Authenticate": "Bearer"})
        return
    subprotocol = _plain_subprotocol(websocket)
    if not config.realtime:
        await websocket.accept(subprotocol)
        unavailable = RealtimeUnavailable()
        await websocket.send_text(ErrorMessage(message=str(unavailable), code=unavailable.code).model_dump_json(
            exclude_none=True))
        await websocket.close(POLICY)
        return
    try:
        lease = context.manager.sessions.reserve()
    except RealtimeBusy as e:
        await _deny(websocket, 429, str(e), e.code, {"Retry-After": str(e.retry_after_s)})
        return
    except ShuttingDown as e:
        await _deny(websocket, 503, str(e), e.code)
        return
    context.metrics.realtime_sessions_open.inc()
    try:
        await websocket.accept(subprotocol)
        await RealtimeSession(websocket, lease, config, context.metrics).run()
    finally:
        lease.release()
        context.metrics.realtime_sessions_open.dec()


async def _deny(websocket: WebSocket, status: int, message: str, code: str,
                headers: dict[str, str] | None = None) -> None:
    """Refuse the upgrade with an HTTP answer (uvicorn's WebSocket implementations can send one), else a close."""
    try:
        await websocket.send_denial_response(error_response(status, message, code, headers=headers))
    except RuntimeError:  # no denial-response extension: the server answers 403
        await websocket.close(TRY_LATER if status in (429, 503) else POLICY)


def _plain_subprotocol(websocket: WebSocket) -> str | None:
    """The first subprotocol the client offered that is not its API key (a browser's `realtime`), to select."""
    offered = websocket.headers.get("sec-websocket-protocol", "")
    plain = [p.strip() for p in offered.split(",") if p.strip() and not p.strip().startswith(KEY_SUBPROTOCOL)]
    return plain[0] if plain else None
