"""Real-time sessions through the executor's rank processes: the chunks equal the offline run, interactions and
stop reach the ranks at chunk boundaries, one session per replica, close frees the ranks, and the refusals."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from realtime_recorder import Recorder

from h3serve.config.engine_config import EngineConfig
from h3serve.engine.executor import Executor
from h3serve.engine.realtime_stream import Interaction, RealtimeBusy, RealtimeSpec, RealtimeUnavailable
from h3serve.errors import RequestError
from h3serve.rank.model_runner import ModelRunner
from h3serve.rank.realtime_loop import generate_offline
from h3serve.rules import realtime_geometry as rt
from h3serve.rules.validate.realtime_plan import plan_realtime
from h3serve.tools.tiny.make_adapter import make_tiny_adapter


@pytest.fixture(scope="module")
def lora_dir(tmp_path_factory):
    return make_tiny_adapter(tmp_path_factory.mktemp("rt") / "taomate", "taomate")


@pytest.fixture(scope="module")
def config(tiny_checkpoint, lora_dir):
    return EngineConfig(model=tiny_checkpoint, threads=1, task_type="fl2va", realtime_lora=str(lora_dir))


@pytest.fixture(scope="module")
def executor(config):
    ex = Executor(config)
    yield ex
    ex.close()


def _open(executor, recorders: list, prompt: str = "fireworks over a harbour", frames: int = 200, seed: int = 9):
    def factory(width: int, height: int) -> Recorder:
        recorders.append(Recorder(width, height))
        return recorders[-1]

    return executor.open_realtime(RealtimeSpec(prompt, 64, 64, seed, frames), writer_factory=factory)


def _drain(stream) -> list:
    chunks = []
    while (chunk := stream.next_chunk(timeout_s=120)) is not None:
        chunks.append(chunk)
    return chunks


def test_a_session_streams_the_offline_run_then_its_trailer(executor, config):
    recorders: list[Recorder] = []
    stream = _open(executor, recorders)
    with pytest.raises(RealtimeBusy):
        executor.open_realtime(RealtimeSpec("x", 64, 64, 1, 10), writer_factory=Recorder)
    chunks = _drain(stream)
    assert [c.kind for c in chunks] == ["media"] * 8 + ["trailer"] and stream.next_chunk(1) is None
    assert [c.index for c in chunks] == [*range(8), 8]
    assert [c.frames for c in chunks[:-1]] == [rt.published_frames(i, 8)[1] for i in range(8)]
    assert chunks[0].segment == b"segment 1" and chunks[-1].segment == b"trailer" and recorders[0].finished
    frames, audio = recorders[0].arrays()
    assert sum(c.audio_samples for c in chunks) == audio.shape[0] == rt.samples_at(243)
    threads, offline = torch.get_num_threads(), Recorder()
    try:
        plan = plan_realtime("fireworks over a harbour", 64, 64, 9, 200, defaults=executor.defaults)
        assert generate_offline(ModelRunner(config), plan, offline) == 8
    finally:
        torch.set_num_threads(threads)
    np.testing.assert_array_equal(frames, offline.arrays()[0])
    np.testing.assert_array_equal(audio, offline.arrays()[1])
    assert not list(executor.spool_dir.glob("chunk-*"))  # every chunk file read and removed


def test_interactions_and_stop_take_effect_at_chunk_boundaries(executor):
    recorders: list[Recorder] = []
    stream = _open(executor, recorders, frames=14_400)
    first = stream.next_chunk(timeout_s=120)
    stream.interact(Interaction("a snowy mountain village", "e1", transition_chunks=2))
    with pytest.raises(RequestError, match="event_id"):
        stream.interact(Interaction("x", ""))
    later = [stream.next_chunk(timeout_s=120) for _ in range(2)]
    stream.stop()
    rest = _drain(stream)
    assert first.index == 0 and first.started_event_ids == ()
    events = [(c.index, c.started_event_ids, c.completed_event_ids) for c in [*later, *rest] if c.started_event_ids]
    # taken after chunk 0 was read: the ranks were at most CHUNKS_AHEAD chunks ahead, so at boundary 1, 2 or 3
    assert len(events) == 1 and 1 <= events[0][0] <= 1 + rt.CHUNKS_AHEAD and events[0][1:] == (("e1",), ("e1",))
    assert rest[-1].kind == "trailer" and len(later) + len(rest) < 8  # stopped long before 484 chunks
    with pytest.raises(RequestError, match="the session has ended"):
        stream.interact(Interaction("late", "e2"))


def test_close_aborts_and_frees_the_ranks(executor):
    stream = _open(executor, [], frames=14_400)
    stream.next_chunk(timeout_s=120)
    stream.close()
    stream.close()  # idempotent
    assert stream.next_chunk(1) is None
    again = _open(executor, [], frames=1)
    assert len(_drain(again)) == 5


def test_refusals(executor, tiny_checkpoint):
    with pytest.raises(RequestError, match="width: the short edge must be one of 64, 480"):
        executor.open_realtime(RealtimeSpec("x", 96, 96, 1, 10), writer_factory=Recorder)
    plain = Executor(EngineConfig(model=tiny_checkpoint, threads=1, task_type="fl2va"))
    try:
        with pytest.raises(RealtimeUnavailable, match="start it with --realtime-lora"):
            plain.open_realtime(RealtimeSpec("x", 64, 64, 1, 10), writer_factory=Recorder)
    finally:
        plain.close()
