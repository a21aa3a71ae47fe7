"""The MP4 encoder beside the decode (h3serve.media.encode_thread): on its own thread (a decode on a device) or inline,
holding the frames up to a bound (a decode on the CPU); either way the synchronous writer's bytes, clips never split,
and a failure on either side leaves no file and reaches the decode."""

from __future__ import annotations

import threading
from contextlib import contextmanager

import numpy as np
import pytest

from h3serve.media.encode_thread import EncodeThread, InlineEncoder, inline_encoder
from h3serve.media.mp4 import EncoderOptions, Mp4Writer, rgb8, write_mp4
from h3serve.media.sink import Mp4Sink

FAST = EncoderOptions(preset="ultrafast", threads=1)


@pytest.fixture(scope="module")
def clip():
    rng = np.random.default_rng(5)
    return rng.random((39, 32, 48, 3), dtype=np.float32), rng.uniform(-0.5, 0.5, (2, 52_000)).astype(np.float32)


class _Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[int, str]] = []
        self.first = threading.Event()

    def write(self, frames: np.ndarray) -> None:
        self.calls.append((len(frames), threading.current_thread().name))
        self.first.set()


def test_clips_go_over_in_batches_never_split():
    recorder = _Recorder()
    with EncodeThread(lambda: _opened(recorder), batch_frames=17) as encoder:
        for _ in range(3):
            encoder.write(np.zeros((5, 2, 2, 3), np.uint8))
        assert not recorder.first.is_set() and encoder._queue.empty()  # 15 frames: still gathering
        encoder.write(np.zeros((5, 2, 2, 3), np.uint8))  # 20 >= 17: handed over
        assert recorder.first.wait(30)
        encoder.write(np.zeros((3, 2, 2, 3), np.uint8))  # the tail, flushed at the end
    assert [n for n, _ in recorder.calls] == [5, 5, 5, 5, 3]
    assert {name for _, name in recorder.calls} == {"h3serve-mp4-encode"}
    start, end = encoder.span
    assert start <= end


@contextmanager
def _opened(writer):
    yield writer


def _encoder(way: str, path, audio):
    """The hand-over `way` ("thread" or "inline") around an `Mp4Writer` of 39 frames at `path`."""
    writer = lambda: Mp4Writer(path, 39, 32, 48, audio, options=FAST)  # noqa: E731
    return EncodeThread(writer) if way == "thread" else inline_encoder(writer, buffer_bytes=17 * 32 * 48 * 3)


@pytest.mark.parametrize("way", ["thread", "inline"])
def test_a_failed_decode_leaves_no_file_and_keeps_its_error(way, clip, tmp_path):
    video, audio = clip
    with pytest.raises(KeyError, match="the decode broke"):
        with _encoder(way, tmp_path / "x.mp4", audio) as writer:
            writer.write(rgb8(video[:17]))
            raise KeyError("the decode broke")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("way", ["thread", "inline"])
def test_an_encoder_error_reaches_the_decode_and_leaves_no_file(way, clip, tmp_path):
    video, audio = clip
    with pytest.raises(ValueError, match="frames must be uint8"):
        with _encoder(way, tmp_path / "x.mp4", audio) as writer:
            writer.write(video[:17])  # float frames: the writer refuses them (on its thread, or at the flush)
            for _ in range(50):  # the next hand-over (or the end) raises it here
                writer.write(rgb8(video[:1]))
    assert list(tmp_path.iterdir()) == []


def test_the_threaded_writer_writes_the_synchronous_bytes(clip, tmp_path):
    video, audio = clip
    write_mp4(tmp_path / "sync.mp4", video, audio, options=FAST)
    frames = rgb8(video)
    with EncodeThread(lambda: Mp4Writer(tmp_path / "thread.mp4", 39, 32, 48, audio, options=FAST), batch_frames=4) as w:
        for start in range(0, 39, 17):
            w.write(frames[start : start + 17])
    assert (tmp_path / "thread.mp4").read_bytes() == (tmp_path / "sync.mp4").read_bytes()


def test_inline_holds_the_frames_up_to_its_bound_and_writes_the_synchronous_bytes(clip, tmp_path):
    video, audio = clip
    write_mp4(tmp_path / "sync.mp4", video, audio, options=FAST)
    frames, frame_bytes = rgb8(video), 32 * 48 * 3
    recorder = _Recorder()
    with inline_encoder(lambda: _opened(recorder), buffer_bytes=30 * frame_bytes) as held:
        for start in range(0, 39, 17):
            held.write(frames[start : start + 17])
            # 17 frames held; 34 >= 30: both clips encoded in this thread; the last 5 at the end
            assert [n for n, _ in recorder.calls] == ([] if start == 0 else [17, 17])
    assert [n for n, _ in recorder.calls] == [17, 17, 5]
    assert {name for _, name in recorder.calls} == {threading.current_thread().name}
    with inline_encoder(lambda: Mp4Writer(tmp_path / "inline.mp4", 39, 32, 48, audio, options=FAST),
                        buffer_bytes=20 * frame_bytes) as held:
        for start in range(0, 39, 17):
            held.write(frames[start : start + 17])
    assert (tmp_path / "inline.mp4").read_bytes() == (tmp_path / "sync.mp4").read_bytes()
    start, end = held.span
    assert start <= end


def test_the_sink_encodes_inline_for_a_cpu_decode_and_on_a_thread_for_a_device_one(clip, tmp_path):
    _, audio = clip
    with Mp4Sink(tmp_path / "cpu.mp4", FAST).open(1, 32, 48, audio) as writer:
        assert isinstance(writer, InlineEncoder)
        writer.write(np.zeros((1, 32, 48, 3), np.uint8))
    # A CUDA decode (this machine has none: its frames are handed over as host arrays, to x264, on a thread).
    with Mp4Sink(tmp_path / "gpu.mp4", FAST, device="cuda").open(1, 32, 48, audio) as writer:
        assert isinstance(writer, EncodeThread)
        writer.write(np.zeros((1, 32, 48, 3), np.uint8))
    assert (tmp_path / "cpu.mp4").read_bytes() == (tmp_path / "gpu.mp4").read_bytes()
