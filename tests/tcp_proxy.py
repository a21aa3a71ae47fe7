"""A loopback TCP proxy in front of a test server (the Ceph gateway), so a test can make the storage misbehave
without touching the shared server: refuse connections (the bucket down), hold requests (slow storage), or pass
the client's bytes at a bounded rate. It records the first line of every HTTP request it forwards."""

from __future__ import annotations

import contextlib
import socket
import threading
import time


class TcpProxy:
    """Forwards 127.0.0.1:`port` to `target`. Modes: open (forward), down (every connection, open or new, is
    closed at once). `hold()` stalls the client's bytes until `release()`; `slow(fragment, rate)` passes the client's
    bytes at `rate` bytes/s on a connection once a request line containing `fragment` was seen on it."""

    def __init__(self, target_url: str):
        host, port = target_url.removeprefix("http://").rstrip("/").split(":")
        self.target = (host, int(port))
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.down = False
        self.rate: float | None = None
        self.slow_fragment = ""
        self.gate = threading.Event()
        self.gate.set()
        self.request_lines: list[str] = []
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def set_down(self, down: bool = True) -> None:
        self.down = down
        if down:
            self._cut()

    def slow(self, fragment: str, rate: float | None) -> None:
        self.slow_fragment, self.rate = fragment, rate

    def hold(self) -> None:
        self.gate.clear()

    def release(self) -> None:
        self.gate.set()

    def saw(self, fragment: str) -> bool:
        with self._lock:
            return any(fragment in line for line in self.request_lines)

    def close(self) -> None:
        self._closed = True
        self.gate.set()
        self.listener.close()
        self._cut()

    def _cut(self) -> None:
        with self._lock:
            conns, self._conns = self._conns, set()
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
            conn.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            if self.down:
                client.close()
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            with self._lock:
                self._conns |= {client, upstream}
            threading.Thread(target=self._pipe, args=(client, upstream, True), daemon=True).start()
            threading.Thread(target=self._pipe, args=(upstream, client, False), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, from_client: bool) -> None:
        throttled = False
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                if from_client:
                    line = self._record(data)  # seen, then held
                    throttled = throttled or bool(line and self.slow_fragment and self.slow_fragment in line)
                    self.gate.wait()
                    if self.down:
                        break
                    self._send_slowly(dst, data, throttled)
                else:
                    dst.sendall(data)
        except OSError:
            pass
        finally:
            for conn in (src, dst):
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)
                conn.close()

    def _record(self, data: bytes) -> str | None:
        line = data.split(b"\r\n", 1)[0]
        if line.split(b" ", 1)[0] not in (b"GET", b"PUT", b"POST", b"HEAD", b"DELETE"):
            return None
        text = line.decode("latin-1")
        with self._lock:
            self.request_lines.append(text)
        return text

    def _send_slowly(self, dst: socket.socket, data: bytes, throttled: bool) -> None:
        if self.rate is None or not throttled:
            dst.sendall(data)
            return
        for start in range(0, len(data), 1024):
            if self.down:
                raise OSError("the proxy went down")
            dst.sendall(data[start:start + 1024])
            time.sleep(1024 / self.rate)
