"""A scripted webhook receiver on loopback for the tests: records every POST and answers each with the next
scripted status (then 200); a 307/308 redirects to `redirect_to`, `HANG` holds the request until `release()`,
`ENDLESS` answers 200 with a body that never ends."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

HANG = -1  # a scripted answer: hold the request until `Receiver.release()`
ENDLESS = -2  # a scripted answer: 200 and a body that never ends (until the client hangs up)


@dataclass
class Received:
    path: str
    headers: dict[str, str]
    body: bytes


@dataclass
class Receiver:
    """Records every POST; answers each with the next scripted status (then 200). A 307/308 answer redirects to
    `redirect_to`; `HANG` holds the request until `release()`."""

    server: ThreadingHTTPServer
    received: list[Received] = field(default_factory=list)
    script: list[int] = field(default_factory=list)
    redirect_to: str = ""
    released: threading.Event = field(default_factory=threading.Event)
    arrived: threading.Condition = field(default_factory=threading.Condition)

    @property
    def port(self) -> int:
        return self.server.server_address[1]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hook"

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.port}"

    def answer(self, *statuses: int) -> None:
        self.script[:] = statuses
        self.released.clear()

    def release(self) -> None:
        self.released.set()

    def wait_for(self, count: int, timeout_s: float = 20.0) -> list[Received]:
        """The first `count` requests, once they have come."""
        with self.arrived:
            if not self.arrived.wait_for(lambda: len(self.received) >= count, timeout_s):
                raise AssertionError(f"{len(self.received)} of {count} webhook requests came in {timeout_s:g} s")
            return self.received[:count]


def _handler(receiver: Receiver) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
            body = self.rfile.read(int(self.headers.get("content-length", 0)))
            status = receiver.script.pop(0) if receiver.script else 200
            with receiver.arrived:
                receiver.received.append(Received(self.path, {k.lower(): v for k, v in self.headers.items()}, body))
                receiver.arrived.notify_all()
            if status == HANG:
                receiver.released.wait(30)
                status = 200
            if status == ENDLESS:
                self.send_response(200)
                self.end_headers()
                with contextlib.suppress(OSError):  # the client stopped reading and hung up
                    for _ in range(100_000):
                        self.wfile.write(b"x" * 4096)
                return
            self.send_response(status)
            if status in (307, 308):
                self.send_header("Location", receiver.redirect_to)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"ok")

    return Handler


@contextlib.contextmanager
def receiver() -> Iterator[Receiver]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), BaseHTTPRequestHandler)
    got = Receiver(server)
    server.RequestHandlerClass = _handler(got)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)  # a prompt shutdown
    thread.start()
    try:
        yield got
    finally:
        got.release()
        server.shutdown()
        server.server_close()
