"""The bridge from a `RealtimeStream` (blocking calls, h3serve.engine.realtime_stream) to the event loop.

One thread owns the stream's blocking calls, `next_chunk` and `close`, which must never run at once (both read the
executor's events). It takes the next chunk only once the previous one was sent (`sent`), so a slow client holds
the engine back instead of piling chunks up in memory, and it closes the stream whatever ends it: the last chunk,
a failure, or the session asking it to stop (`close`), after which the ranks are free for the next job.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable

from h3serve.engine.realtime_stream import RealtimeChunk, RealtimeStream

log = logging.getLogger("h3serve.realtime")
POLL_S = 0.25  # how often the thread looks up from a wait to see whether the session wants it to stop

Delivery = RealtimeChunk | BaseException | None  # a chunk, what ended the stream, or None: it ended cleanly


class ChunkPump:
    def __init__(self, stream: RealtimeStream, loop: asyncio.AbstractEventLoop):
        self.stream, self.loop = stream, loop
        self.chunks: asyncio.Queue[Delivery] = asyncio.Queue()
        self._credit = threading.Semaphore(1)  # chunks the session is ready to send
        self._closing = threading.Event()
        self._done = loop.create_future()
        self._thread = threading.Thread(target=self._run, name="h3serve-realtime-pump", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def sent(self) -> None:
        """The session sent the last chunk delivered: the thread may take the next one."""
        self._credit.release()

    async def close(self) -> None:
        """Stop taking chunks and wait until the stream is closed (at once if it ended; else the engine is aborted:
        its ranks stop at their next chunk boundary, or are restarted)."""
        self._closing.set()
        self._credit.release()
        await asyncio.shield(self._done)

    def _run(self) -> None:
        try:
            while self._take_credit():
                chunk = self._next_chunk()
                if self._closing.is_set():
                    break
                self._deliver(chunk)
                if chunk is None:
                    break
        except BaseException as e:  # noqa: BLE001 - whatever ended the stream is the session's to report
            self._deliver(e)
        finally:
            try:
                self.stream.close()
            except Exception:
                log.exception("closing a real-time stream failed")
            self._call_soon(self._set_done)

    def _take_credit(self) -> bool:
        while not self._closing.is_set():
            if self._credit.acquire(timeout=POLL_S):
                return not self._closing.is_set()
        return False

    def _next_chunk(self) -> RealtimeChunk | None:
        while not self._closing.is_set():
            try:
                return self.stream.next_chunk(timeout_s=POLL_S)
            except TimeoutError:
                continue
        return None

    def _deliver(self, item: Delivery) -> None:
        self._call_soon(lambda: self.chunks.put_nowait(item))

    def _set_done(self) -> None:
        if not self._done.done():
            self._done.set_result(None)

    def _call_soon(self, callback: Callable[[], object]) -> None:
        try:
            self.loop.call_soon_threadsafe(callback)
        except RuntimeError:  # the loop is closed (the server is gone): nobody waits any more
            pass
