"""The MP4 encoder on its own thread, fed as the video decode emits its frames (the output stage overlaps the decode).

`EncodeThread` runs a frame writer (an `Mp4Writer`, with its preview keeper) on a thread of its own: the decode
hands it each VAE clip's uint8 frames and goes on with the next clip while x264 (or NVENC) encodes this one. The
writer is opened, fed and closed on that thread in exactly the order a synchronous writer would be, so the file
holds the same bytes (the encoder's bitstream depends on its input and settings, not on which thread calls it).

The queue between the two holds at most `depth` batches (2: one being encoded, one waiting, as vLLM-Omni's
pre-encode ring), so a decode that outruns its encoder waits instead of piling frames up; `batch_frames` gathers
clips into batches of at least that many frames (vLLM-Omni's `preencode_batch_frames`; a clip is never split,
the tail is flushed at the end). A failure on either side ends both: an encoder error is raised in the decode at
its next `write` (or at the end), a decode error stops the encoder and leaves no file (the writer's own abort).

That overlap pays where the decode runs on a GPU. A decode on the CPU shares the encoder's cores, so there
`InlineEncoder` takes the same hand-over and encodes in the caller's thread, never beside the decode.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from types import TracebackType
from typing import Any, Protocol

_DONE = object()  # the decode finished: close the file
_ABORT = object()  # the decode failed: leave no file
_POLL_S = 0.2  # how often a blocked hand-over checks that the encoder thread is still alive


class ChunkWriter(Protocol):
    def write(self, frames: Any) -> None: ...


class _Aborted(Exception):
    """Raised inside the writer's block on the encoder thread, so that it discards the file."""


class EncodeThread:
    """A frame writer on its own thread, used as a context manager around the decode loop: `write` hands over
    one clip's frames (owned by the writer from then on: the caller must not reuse the array); leaving the block
    waits for the encoder to finish the file, and raises its error if it failed."""

    on_device = False

    def __init__(
        self,
        open_writer: Callable[[], AbstractContextManager[ChunkWriter]],
        depth: int = 2,
        batch_frames: int = 1,
        name: str = "h3serve-mp4-encode",
        on_device: bool = False,
    ):
        if depth < 1 or batch_frames < 1:
            raise ValueError(f"depth and batch_frames must be >= 1, got {depth} and {batch_frames}")
        self._open_writer = open_writer
        self._queue: queue.Queue[object] = queue.Queue(maxsize=depth)
        self._batch: list[Any] = []
        self._batch_frames = batch_frames
        self._batched = 0
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._start: float | None = None
        self._end: float | None = None
        self.on_device = on_device

    @property
    def span(self) -> tuple[float, float] | None:
        """(start, end) on the `time.monotonic` clock: from the first frames it took to the file being closed."""
        if self._start is None or self._end is None:
            return None
        return self._start, self._end

    def __enter__(self) -> EncodeThread:
        self._thread.start()
        return self

    def write(self, frames: Any) -> None:
        """Hand over the next frames [t, H, W, 3] (a whole clip; batched up to `batch_frames` first)."""
        self._raise_if_failed()
        self._batch.append(frames)
        self._batched += len(frames)
        if self._batched >= self._batch_frames:
            self._hand_over()

    def _hand_over(self) -> None:
        if self._batch:
            self._put(self._batch)
            self._batch, self._batched = [], 0

    def _put(self, item: object) -> None:
        while True:
            try:
                self._queue.put(item, timeout=_POLL_S)
                return
            except queue.Full:
                self._raise_if_failed()
                if not self._thread.is_alive():
                    raise RuntimeError("the MP4 encoder thread stopped") from None

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error  # the encoder's own error (its traceback ends on the encoder thread)

    def _run(self) -> None:
        told = False  # the decode said it is done (or failed): nothing more comes
        try:
            with self._open_writer() as writer:
                while True:
                    item = self._queue.get()
                    if item is _DONE or item is _ABORT:
                        told = True
                        if item is _ABORT:
                            raise _Aborted
                        break
                    if self._start is None:
                        self._start = time.monotonic()
                    for frames in item:  # type: ignore[attr-defined]
                        writer.write(frames)
        except _Aborted:
            pass
        except BaseException as e:  # reported to the decode at its next write or at the end
            self._error = e
            if not told:
                self._drain()
        finally:
            self._end = time.monotonic()

    def _drain(self) -> None:
        """After a failure: take what the decode still hands over until it says it is done (its block always
        does, leaving normally or not), so that it never blocks on a full queue."""
        while self._queue.get() not in (_DONE, _ABORT):
            pass

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None
    ) -> None:
        if kind is None:
            try:
                self._hand_over()
            finally:
                self._put(_DONE)
                self._thread.join()
            self._raise_if_failed()
            return
        # The decode failed: the encoder stops and its writer leaves no file; the decode's error is raised.
        self._batch = []
        try:
            self._put(_ABORT)
        except RuntimeError:
            pass  # the encoder had failed already
        self._thread.join()


# What an `InlineEncoder` holds before it encodes: a few seconds of frames at the released 1344x768 (3 MiB each).
INLINE_BUFFER_BYTES = 256 * 2**20


class InlineEncoder:
    """The same hand-over as `EncodeThread` for a decode that runs on the CPU, whose cores the encoder needs as
    well: the frames are held (up to `buffer_bytes`) and encoded in the caller's thread when the buffer is full
    and when the decode ends, never beside the decode. Overlapped, the two only oversubscribe the cores: the
    decode's OpenMP threads wait at their barriers for threads x264 displaced, and x264's frame threads finish
    each clip while the next one decodes. On two cores a Turbo request's output stage took 0.65 s on its own
    thread, 0.58 s encoded clip by clip inline, 0.52 s held and encoded after (docs/benchmarks.md). The memory
    stays bounded: at most `buffer_bytes` of uint8 frames besides one clip."""

    on_device = False

    def __init__(self, writer: ChunkWriter, buffer_bytes: int = INLINE_BUFFER_BYTES):
        self._writer = writer
        self._buffer_bytes = buffer_bytes
        self._held: list[Any] = []
        self._held_bytes = 0
        self._start: float | None = None
        self._end: float | None = None

    @property
    def span(self) -> tuple[float, float] | None:
        """(start, end) on the `time.monotonic` clock: from the first frames encoded to the file being closed."""
        return None if self._start is None or self._end is None else (self._start, self._end)

    def write(self, frames: Any) -> None:
        """Take the next frames [t, H, W, 3] (owned from then on); encode what is held once it passes the bound."""
        self._held.append(frames)
        self._held_bytes += frames.nbytes
        if self._held_bytes >= self._buffer_bytes:
            self.flush()

    def flush(self) -> None:
        if self._held and self._start is None:
            self._start = time.monotonic()
        for frames in self._held:
            self._writer.write(frames)
        self._held, self._held_bytes = [], 0


@contextmanager
def inline_encoder(
    open_writer: Callable[[], AbstractContextManager[ChunkWriter]], buffer_bytes: int = INLINE_BUFFER_BYTES
) -> Iterator[InlineEncoder]:
    """An `InlineEncoder` on the writer `open_writer` opens; the file is whole (or, after an error on either side,
    absent) when the block ends."""
    with open_writer() as writer:
        encoder = InlineEncoder(writer, buffer_bytes)
        yield encoder
        encoder.flush()
    encoder._end = time.monotonic()
