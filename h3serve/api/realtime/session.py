"""One `WS /v1/realtime/video` session, from `session.start` to its close, on a replica the route has reserved.

Two tasks share the socket: the sender takes the engine's chunks (pump.py) and sends, per chunk, its
`video.chunk_metadata` and then its segment; the reader handles the client's control messages (a new prompt, ping,
stop). Whatever ends the session (the last chunk, a protocol error, a failed engine, the stall timeout, the client
leaving) goes through one `finally`: the reader stops, the stream is closed (the ranks free for the next job) and the
socket is closed with a code that says why; the client has read an `error` message first unless it left.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable
from typing import Any

from pydantic import BaseModel
from starlette.websockets import WebSocket, WebSocketDisconnect

from h3serve.api.prometheus import Metrics
from h3serve.api.realtime.events import (
    ChunkMetadata,
    ErrorMessage,
    InteractionQueued,
    Pong,
    SessionDone,
    SessionInteraction,
    SessionPing,
    SessionStart,
    VideoStart,
)
from h3serve.api.realtime.parse import (
    INTERNAL,
    NORMAL,
    POLICY,
    RESTART,
    TRY_LATER,
    ProtocolError,
    parse_control,
    parse_start,
)
from h3serve.api.realtime.pump import ChunkPump
from h3serve.api.server_config import ServerConfig
from h3serve.engine.jobs.sessions import SessionLease
from h3serve.engine.jobs.types import ShuttingDown
from h3serve.engine.realtime_stream import Interaction, RealtimeBusy, RealtimeChunk, RealtimeSpec, RealtimeStream
from h3serve.errors import ClientError, H3ServeError, job_error_for
from h3serve.rules import limits

log = logging.getLogger("h3serve.realtime")
REPORT_GRACE_S = 5.0  # how long the `error` message that ends a session may take to send


class ClientGone(Exception):
    """The client closed the socket or the connection dropped: nothing more can be sent."""


class RealtimeSession:
    def __init__(self, websocket: WebSocket, lease: SessionLease, config: ServerConfig, metrics: Metrics):
        self.ws, self.lease, self.config, self.metrics = websocket, lease, config, metrics
        self.request_id = f"video_stream-{uuid.uuid4().hex}"
        self.sent = 0  # segments sent
        self.stop_requested = False
        self.last_progress = time.monotonic()  # a chunk sent or a ping: the stall clock
        self.event_ids: set[str] = set()
        self.started = time.monotonic()  # when session.start arrived
        self._send_lock = asyncio.Lock()

    async def run(self) -> None:
        """The whole session; returns once the socket is closed and the stream with it."""
        pump: ChunkPump | None = None
        reader: asyncio.Task[None] | None = None
        close_code: int | None = NORMAL
        try:
            start = await self._receive_start()
            spec = start.spec(self.config.served_model_name)
            stream = await asyncio.to_thread(self.lease.open, spec)
            pump = ChunkPump(stream, asyncio.get_running_loop())
            pump.start()
            await self._send(VideoStart(request_id=self.request_id, config=_config(start, spec)))
            reader = asyncio.create_task(self._read_controls(stream))
            await self._send_chunks(pump, reader)
            await self._send(SessionDone(request_id=self.request_id, chunks=self.sent, stopped=self.stop_requested))
        except ClientGone:
            close_code = None
        except Exception as e:  # noqa: BLE001 - every way a session fails ends in an error message and a close
            close_code = await self._report(e)
        finally:
            if reader is not None:
                reader.cancel()
                await asyncio.gather(reader, return_exceptions=True)
            if close_code is not None:
                await self._close(close_code)
            if pump is not None:  # after the close: an abort may take the engine a few seconds
                await pump.close()

    # -- the start ---------------------------------------------------------------------------------------------

    async def _receive_start(self) -> SessionStart:
        timeout = self.config.realtime_start_timeout_s
        try:
            frame = await asyncio.wait_for(self._receive(), timeout)
        except TimeoutError:
            raise ProtocolError("start_timeout", f"no session.start within {timeout:g} s") from None
        self.started = time.monotonic()
        return parse_start(frame)

    # -- the chunks ----------------------------------------------------------------------------------------------

    async def _send_chunks(self, pump: ChunkPump, reader: asyncio.Task[None]) -> None:
        """Send every chunk until the stream ends; raises what ended it otherwise (the reader's error included)."""
        stall = self.config.realtime_stall_timeout_s
        previous = self.started
        while True:
            taking = asyncio.ensure_future(pump.chunks.get())
            left = stall - (time.monotonic() - self.last_progress)
            done, _ = await asyncio.wait({taking, reader}, timeout=max(left, 0), return_when=asyncio.FIRST_COMPLETED)
            if taking not in done:
                taking.cancel()
                if reader in done:
                    reader.result()  # the client left or broke the protocol: raises
                if time.monotonic() - self.last_progress < stall:
                    continue  # a ping moved the stall clock while we waited
                raise ProtocolError("stall_timeout", f"no generation progress for {stall:g} s", INTERNAL)
            item = taking.result()
            if item is None:
                return
            if isinstance(item, BaseException):
                raise item
            await self._send_chunk(item)
            pump.sent()
            now = time.monotonic()
            self.metrics.on_realtime_chunk(item.kind, now - previous, item.frames / limits.FPS, first=self.sent == 1)
            previous = now

    async def _send_chunk(self, chunk: RealtimeChunk) -> None:
        metadata = ChunkMetadata.of(chunk, self.request_id, self.sent).model_dump_json()
        async with self._send_lock:  # the metadata and its segment go out together
            await self._transmit(self.ws.send_text(metadata))
            await self._transmit(self.ws.send_bytes(chunk.segment))
        self.sent += 1
        self.last_progress = time.monotonic()

    # -- the client's messages -------------------------------------------------------------------------------

    async def _read_controls(self, stream: RealtimeStream) -> None:
        """Handle control messages until the client leaves (`ClientGone`) or breaks the protocol (`ProtocolError`)."""
        while True:
            message = parse_control(await self._receive())
            if isinstance(message, SessionPing):
                self.last_progress = time.monotonic()
                await self._send(Pong())
            elif isinstance(message, SessionInteraction):
                await self._interact(stream, message)
            else:  # session.stop: the chunk in flight, the trailer, then session.done
                self.stop_requested = True
                stream.stop()

    async def _interact(self, stream: RealtimeStream, message: SessionInteraction) -> None:
        body = message.interaction
        event_id = body.event_id or uuid.uuid4().hex
        if event_id in self.event_ids:
            await self._send(ErrorMessage(message=f"event_id {event_id!r} was used before in this session",
                                          code="event_id_conflict", request_id=self.request_id, event_id=event_id))
            return
        try:
            stream.interact(Interaction(body.event.prompt, event_id, body.transition_chunks or 0))
        except ClientError as e:  # the session goes on; only this interaction is refused
            await self._send(ErrorMessage(message=str(e), code=e.code, request_id=self.request_id, event_id=event_id))
            return
        self.event_ids.add(event_id)
        await self._send(InteractionQueued(request_id=self.request_id, event_id=event_id))

    # -- the socket ------------------------------------------------------------------------------------------

    async def _receive(self) -> dict[str, Any]:
        try:
            frame = await self.ws.receive()
        except (WebSocketDisconnect, RuntimeError, OSError):
            raise ClientGone() from None
        if frame["type"] == "websocket.disconnect":
            raise ClientGone()
        return dict(frame)

    async def _send(self, message: BaseModel, timeout_s: float | None = None) -> None:
        text = message.model_dump_json(exclude_none=isinstance(message, ErrorMessage))
        async with self._send_lock:
            await self._transmit(self.ws.send_text(text), timeout_s)

    def stall_left(self) -> float:
        """Seconds until the stall timeout, counted from the last progress (a chunk sent, or a ping)."""
        return max(0.0, self.config.realtime_stall_timeout_s - (time.monotonic() - self.last_progress))

    async def _transmit(self, sending: Awaitable[None], timeout_s: float | None = None) -> None:
        """Send, or `ClientGone`: a client that reads nothing is let go when the stall timeout runs out, counted
        from the last progress (a send that waited the whole timeout after the engine had taken part of it held
        the replica for both)."""
        try:
            await asyncio.wait_for(sending, self.stall_left() if timeout_s is None else timeout_s)
        except (WebSocketDisconnect, RuntimeError, OSError, TimeoutError):
            raise ClientGone() from None

    async def _report(self, error: Exception) -> int:
        """Send the `error` message for what ended the session; the close code to use."""
        code, message, close_code = _error_fields(error)
        grace = min(REPORT_GRACE_S, self.config.realtime_stall_timeout_s)  # the stall clock may have run out
        try:
            await self._send(ErrorMessage(message=message, code=code, request_id=self.request_id), grace)
        except ClientGone:
            pass
        return close_code

    async def _close(self, code: int) -> None:
        try:
            await self.ws.close(code)
        except (RuntimeError, OSError):  # already closed by the client
            pass


def _error_fields(error: Exception) -> tuple[str, str, int]:
    """(code, client-safe message, close code) of what ended a session."""
    if isinstance(error, ProtocolError):
        return error.code, error.message, error.close_code
    if isinstance(error, RealtimeBusy):
        return error.code, str(error), TRY_LATER
    if isinstance(error, ShuttingDown):
        return error.code, str(error), RESTART
    if isinstance(error, ClientError):
        return error.code, str(error), POLICY
    if not isinstance(error, H3ServeError):
        log.error("real-time session failed", exc_info=error)
    failure = job_error_for(error)
    return failure.code, failure.message, INTERNAL


def _config(start: SessionStart, spec: RealtimeSpec) -> dict[str, Any]:
    """`video.start`'s config: the settings as given, with what the session resolved them to."""
    given = start.model_dump(exclude_none=True, exclude={"type", "format"})
    return {**given, "prompt": spec.prompt, "width": spec.width, "height": spec.height, "seed": spec.seed,
            "num_frames": spec.num_frames, "fps": limits.FPS}
