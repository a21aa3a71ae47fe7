"""The uvicorn server h3serve runs the app on: hardened against slow and abusive clients, draining on SIGTERM.

- A connection must finish its request headers within `header_timeout_s` (else 408 and closed); a body that
  stalls gets 408 and is closed too (`body_timeout.py`: `body_timeout_s` idle, a deadline scaled to its length);
  both are counted in /metrics. An idle keep-alive connection is closed after `keep_alive_timeout_s`.
- Past `max_connections` open connections a new one gets a JSON 503 `too_many_connections` and is closed at
  once, so file descriptors stay free for the jobs (spool files, the store, the ranks' pipes).
- Malformed requests (e.g. `Content-Length: -1`) get the JSON error envelope, not uvicorn's plain text.
- SIGTERM/SIGINT, in a strict order: stop taking work (no connection, no job), let the running job finish within
  `shutdown_grace_s` (else cancel it back into the queue), answer every /sync waiter (503 `shutting_down`),
  wait for the requests to end, then return normally so the caller's clean-up runs and closes the store last
  (uvicorn would re-raise the signal and kill the process before it).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
from collections.abc import Generator
from typing import Any, ClassVar

import h11
import uvicorn
from fastapi import FastAPI
from uvicorn.protocols.http.h11_impl import H11Protocol

from h3serve.api.body_timeout import BodyTimeouts
from h3serve.api.log_limit import RateLimitFilter
from h3serve.api.prometheus import Metrics
from h3serve.api.realtime.handshake import EnvelopeWebSocketProtocol
from h3serve.api.server_config import ServerConfig
from h3serve.engine.jobs import JobManager

log = logging.getLogger("h3serve.http")
# Loggers a flood of hostile clients can drive: a few lines per cause per window, whatever the flood.
FLOODABLE_LOGGERS = ("h3serve.http", "h3serve.api", "uvicorn.error", "uvicorn.access", "asyncio")


def limit_log_floods() -> None:
    for name in FLOODABLE_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, RateLimitFilter) for f in logger.filters):
            logger.addFilter(RateLimitFilter())


def _canned(status: int, reason: str, message: str, code: str, extra: str = "") -> bytes:
    """A whole HTTP/1.1 response with the OpenAI error envelope, for answers given outside the app."""
    body = json.dumps(
        {
            "error": {
                "message": message,
                "type": "invalid_request_error" if status < 500 else "server_error",
                "param": None,
                "code": code,
            }
        }
    ).encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
        f"connection: close\r\n{extra}\r\n"
    )
    return head.encode() + body


class HardenedH11Protocol(BodyTimeouts, H11Protocol):
    """uvicorn's h11 protocol with header and body deadlines, a connection cap and JSON protocol errors.

    At the cap a new connection first evicts the oldest connection that holds no request (headers still
    incomplete, or idle between keep-alive requests): slow clients cannot lock out a prober or a real client.
    Only when every connection is busy with a request is the newcomer refused with 503."""

    limits: ClassVar[ServerConfig]
    idle: ClassVar[dict[HardenedH11Protocol, None]]  # connections holding no request, oldest first
    metrics: ClassVar[Metrics | None] = None  # counts the 408s

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._header_timer: asyncio.TimerHandle | None = None
        if len(self.connections) > self.limits.max_connections and not self._evict_oldest_idle():
            log.warning(
                "refused a connection: %d open, all busy; --max-connections is %d",
                len(self.connections) - 1,
                self.limits.max_connections,
            )
            transport.write(
                _canned(
                    503,
                    "Service Unavailable",
                    f"The server holds its maximum of {self.limits.max_connections} connections; retry shortly.",
                    "too_many_connections",
                    "retry-after: 1\r\n",
                )
            )
            transport.close()
            return
        self._arm_header_timer()

    def _evict_oldest_idle(self) -> bool:
        while self.idle:
            victim = next(iter(self.idle))
            self.idle.pop(victim)
            if not victim.transport.is_closing():
                log.warning(
                    "closed the oldest connection holding no request: --max-connections %d reached",
                    self.limits.max_connections,
                )
                victim._disarm_header_timer()
                victim.transport.close()
                return True
        return False

    def data_received(self, data: bytes) -> None:
        if self.transport.is_closing():
            return
        super().data_received(data)
        if self.conn.their_state is h11.IDLE:  # a request line or headers are still incomplete
            self._arm_header_timer()
        else:
            self._disarm_header_timer()
            self.watch_body()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
            self.idle[self] = None  # between keep-alive requests (uvicorn's keep-alive timer closes it)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_timer()
        self.stop_body_watch()
        super().connection_lost(exc)

    def _arm_header_timer(self) -> None:
        self.idle.pop(self, None)
        self.idle[self] = None  # newest last
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(self.limits.header_timeout_s, self._headers_too_slow)

    def _disarm_header_timer(self) -> None:
        self.idle.pop(self, None)
        timer: asyncio.TimerHandle | None = getattr(self, "_header_timer", None)
        if timer is not None:
            timer.cancel()
            self._header_timer = None

    def _headers_too_slow(self) -> None:
        self._header_timer = None
        self.idle.pop(self, None)
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        self.time_out("headers", f"The request headers did not arrive within {self.limits.header_timeout_s:g} s.")

    def time_out(self, phase: str, message: str) -> None:
        if self.metrics is not None:
            self.metrics.count_request_timeout(phase)
        if self.conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):  # no response started: a 408 tells an honest
            self.transport.write(_canned(408, "Request Timeout", message, "request_timeout"))  # slow client why
        self.transport.close()

    def send_400_response(self, msg: str) -> None:
        log.warning("invalid HTTP request from %s: %s", self.client[0] if self.client else "?", msg)
        self.transport.write(
            _canned(400, "Bad Request", f"{msg} (malformed request line or headers)", "invalid_http_request")
        )
        self.transport.close()


class H3Server(uvicorn.Server):
    """uvicorn.Server that drains the job manager on shutdown and returns instead of re-raising the signal."""

    def __init__(self, config: uvicorn.Config, manager: JobManager, grace_s: float):
        super().__init__(config)
        self.manager = manager
        self.grace_s = grace_s

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        with super().capture_signals():
            yield
            self._captured_signals.clear()  # handled: run() returns and the caller's clean-up runs

    async def shutdown(self, sockets: Any = None) -> None:
        """Stop in a strict order: take no more work, answer every waiter, and only then let `run` return (the
        caller closes the store after it)."""
        for server in self.servers:  # no new connections while the running job gets its grace period
            server.close()
        # No new job, the grace period, the running jobs cancelled, every /sync waiter woken (it answers 503).
        await asyncio.to_thread(self.manager.drain, self.grace_s)
        # uvicorn waits `timeout_graceful_shutdown` for the responses, cancels the requests still running
        # (`LastResort` answers them 503), then runs the lifespan's shutdown (the manager's close).
        await super().shutdown(sockets)
        await self._wait_for_requests(REQUEST_EXIT_S)

    async def _wait_for_requests(self, timeout_s: float) -> None:
        """Wait for the cancelled requests to end. They may still be in a store call (a thread the cancel does not
        interrupt); left running, `asyncio.run` would cancel them again, abandon that thread and return, and the
        caller would close the store under it."""
        tasks = set(self.server_state.tasks)
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=timeout_s)
            if pending:
                log.warning("%d request(s) still running %g s after they were cancelled", len(pending), timeout_s)


# How long the shutdown waits for the requests it cancelled to end (a store call in flight) before returning.
REQUEST_EXIT_S = 5.0
# Descriptors the server needs besides its connections: spool and media files, SQLite, the ranks' pipes, libraries.
RESERVED_FDS = 256


def reserve_descriptors(max_connections: int) -> int:
    """Raise the soft open-files limit towards the hard one so that `max_connections` connections leave
    `RESERVED_FDS` for the jobs; returns the connection cap that fits (lower, with a warning, if the hard
    limit is too small). A job must never fail with 'Too many open files' because of the HTTP layer."""
    try:
        import resource
    except ImportError:  # not POSIX: nothing to raise
        return max_connections
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = max_connections + RESERVED_FDS
    if soft != resource.RLIM_INFINITY and soft < wanted:
        raised = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
            soft = raised
        except (ValueError, OSError):  # above the kernel's own cap (nr_open): keep the current limit
            pass
    fits = max_connections if soft == resource.RLIM_INFINITY else min(max_connections, soft - RESERVED_FDS)
    if fits < max_connections:
        log.warning("--max-connections %d lowered to %d: the open-files limit is %d", max_connections, fits, soft)
    return max(1, fits)


def build_server(app: FastAPI, config: ServerConfig, **overrides: Any) -> H3Server:
    """The server for `app` (made by create_app) under `config`; `overrides` are uvicorn.Config settings."""
    limit_log_floods()
    config = dataclasses.replace(config, max_connections=reserve_descriptors(config.max_connections))
    protocol = type("H3Protocol", (HardenedH11Protocol,),
                    {"limits": config, "idle": {}, "metrics": app.state.context.metrics})
    settings: dict[str, Any] = dict(
        host=config.host,
        port=config.port,
        http=protocol,
        ws=EnvelopeWebSocketProtocol,  # refused upgrades answer in the JSON error envelope
        timeout_keep_alive=config.keep_alive_timeout_s,
        # After the drain only responses already being written remain: a few seconds suffice.
        timeout_graceful_shutdown=5,
        backlog=min(2048, config.max_connections),
    )
    uv_config = uvicorn.Config(app, **{**settings, **overrides})
    return H3Server(uv_config, app.state.context.manager, config.shutdown_grace_s)
