"""Request bodies that stall: the body half of the HTTP server's slow-client guards (headers: http_server).

Once a request's headers are in, its body is watched:
- idle: no body bytes for `body_timeout_s` (`--body-timeout`, default 30 s);
- overall: the whole body within `body_timeout_s` + its declared length at `MIN_BODY_RATE` (64 KiB/s: a 64 MiB
  body gets 30 + 1024 s); a chunked body, which declares none, is given the body cap's time.
Either way the client gets a JSON 408 `request_timeout` (unless a response is already under way) and the
connection is closed; `/metrics` counts it (`h3serve_request_timeouts_total{phase="body"}`). Time in which the
server, not the client, holds the body back does not count: while uvicorn has paused reading (the app has not
consumed what arrived) or the client waits for `100 Continue`.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, ClassVar

import h11

MIN_BODY_RATE = 64 * 1024  # bytes per second: the slowest steady upload the overall deadline allows for

log = logging.getLogger("h3serve.http")


def body_deadline_s(timeout_s: float, declared: int) -> float:
    """Seconds a body of `declared` bytes has to arrive in full."""
    return timeout_s + declared / MIN_BODY_RATE


class BodyTimeouts:
    """Mixed into the h11 protocol (it provides loop, conn, flow, cycle, headers, transport, limits, time_out)."""

    loop: asyncio.AbstractEventLoop
    conn: h11.Connection
    flow: Any
    cycle: Any
    headers: list[tuple[bytes, bytes]]
    transport: asyncio.Transport
    limits: ClassVar[Any]

    _body_timer: asyncio.TimerHandle | None = None
    _body_cycle: object = None  # the request whose body is watched

    def watch_body(self) -> None:
        """Called after every read: notes body progress, and starts watching a new request's body."""
        if self.conn.their_state is not h11.SEND_BODY or self.cycle is None:
            return
        now = self.loop.time()
        self._body_last = now
        if self._body_cycle is not self.cycle:  # a new request (keep-alive connections carry several)
            self.stop_body_watch()
            self._body_cycle = self.cycle
            declared = dict(self.headers).get(b"content-length", b"")
            length = int(declared) if declared.isdigit() else self.limits.max_body_bytes
            self._body_deadline = now + body_deadline_s(self.limits.body_timeout_s, length)
            self._body_checked = now
            self._body_timer = self.loop.call_later(self.limits.body_timeout_s, self._check_body)

    def stop_body_watch(self) -> None:
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None
        self._body_cycle = None

    def _check_body(self) -> None:
        self._body_timer = None
        watched = self.conn.their_state is h11.SEND_BODY and self.cycle is self._body_cycle
        if self.transport.is_closing() or not watched:
            self._body_cycle = None
            return
        now, timeout = self.loop.time(), self.limits.body_timeout_s
        if self.flow.read_paused or getattr(self.cycle, "waiting_for_100_continue", False):
            self._body_deadline += now - self._body_checked  # the server holds the body back, not the client
            self._body_last = now
        self._body_checked = now
        if now >= self._body_deadline:
            self._expire(f"The request body did not arrive in full within {self._body_deadline_total():g} s.")
        elif now - self._body_last >= timeout:
            self._expire(f"The request body sent nothing for {timeout:g} s.")
        else:
            wake = min(self._body_last + timeout, self._body_deadline) - now
            self._body_timer = self.loop.call_later(max(wake, 0.01), self._check_body)

    def _body_deadline_total(self) -> float:
        declared = dict(self.headers).get(b"content-length", b"")
        length = int(declared) if declared.isdigit() else self.limits.max_body_bytes
        return round(body_deadline_s(self.limits.body_timeout_s, length), 1)

    def time_out(self, phase: str, message: str) -> None:
        """Provided by the protocol: count, answer 408 if no response is under way, and close."""
        raise NotImplementedError

    def _expire(self, message: str) -> None:
        self._body_cycle = None
        log.warning("closed a connection whose request body stalled: %s", message)
        self.time_out("body", message)
