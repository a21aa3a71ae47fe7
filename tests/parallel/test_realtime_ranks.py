"""A real-time session under Ulysses 2 (the clean K/V cache per head shard, the causal core inside the all-to-all)
gives the one-rank session's frames and audio (gloo ranks, 1 thread each)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from rank_harness import run_ranks
from realtime_recorder import Recorder
from realtime_sessions import realtime_cases
from tiny_parallel import PARALLEL_DIT

from h3serve.config.engine_config import EngineConfig
from h3serve.engine.executor import Executor
from h3serve.engine.realtime_stream import Interaction, RealtimeSpec
from h3serve.rank.model_runner import ModelRunner
from h3serve.rank.realtime_loop import generate_offline
from h3serve.rules import realtime_geometry as rt
from h3serve.rules.validate.realtime_plan import plan_realtime
from h3serve.tools.tiny.make_adapter import write_taomate_adapter

pytestmark = pytest.mark.slow


def test_ulysses_2_equals_one_rank(parallel_checkpoint, tmp_path):
    lora = write_taomate_adapter(tmp_path / "taomate", dict(PARALLEL_DIT), rank=4)
    ranks = run_ranks(2, realtime_cases, parallel_checkpoint, str(lora), 125)  # two requests: 8 chunks
    (frames, audio), (u_frames, u_audio) = ranks[0]["reference"], ranks[0]["ulysses"]
    assert frames.shape == (rt.session_frames(8), 64, 64, 3) and u_frames.shape == frames.shape
    assert ranks[0]["heads"] == ranks[1]["heads"] == 2 and ranks[1]["ulysses"] == 8  # rank 1 delivers no media
    # the same math per head shard; the attention kernels' blocking may differ in the last bits
    assert np.abs(u_frames.astype(int) - frames.astype(int)).max() <= 1
    np.testing.assert_allclose(u_audio, audio, atol=1e-4)


def test_a_session_through_two_ulysses_rank_processes(parallel_checkpoint, tmp_path):
    """The executor's path on two ranks: rank 0 decides each boundary and broadcasts it; the chunks equal the
    one-rank session's; an interaction and a stop reach both ranks at the same boundary."""
    lora = str(write_taomate_adapter(tmp_path / "taomate", dict(PARALLEL_DIT), rank=4))
    config = EngineConfig(model=parallel_checkpoint, threads=1, task_type="fl2va", realtime_lora=lora)
    threads, reference = torch.get_num_threads(), Recorder()
    try:
        engine = ModelRunner(config)
        generate_offline(engine, plan_realtime("a harbour at night", 64, 64, 4, 100, defaults=engine.defaults),
                         reference)
        del engine
    finally:
        torch.set_num_threads(threads)
    executor = Executor(dataclasses.replace(config, ulysses_degree=2, num_ranks=2))
    try:
        recorder = Recorder()
        stream = executor.open_realtime(RealtimeSpec("a harbour at night", 64, 64, 4, 100),
                                        writer_factory=lambda w, h: recorder)
        while stream.next_chunk(timeout_s=300) is not None:
            pass
        assert np.abs(recorder.arrays()[0].astype(int) - reference.arrays()[0].astype(int)).max() <= 1
        stream = executor.open_realtime(RealtimeSpec("a harbour at night", 64, 64, 4, 14_400),
                                        writer_factory=Recorder)
        stream.next_chunk(timeout_s=300)
        stream.interact(Interaction("a desert at noon", "e1"))
        chunks = [stream.next_chunk(timeout_s=300) for _ in range(rt.CHUNKS_AHEAD + 1)]
        stream.stop()
        while (chunk := stream.next_chunk(timeout_s=300)) is not None:
            chunks.append(chunk)
        assert [c.started_event_ids for c in chunks].count(("e1",)) == 1 and chunks[-1].kind == "trailer"
    finally:
        executor.close()
