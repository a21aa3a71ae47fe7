"""A real-time session on the loaded engine: the offline run, interactions at chunk boundaries (the text states that
reach the DiT, the event ids), stop and cancel, and the refusals of what TaoMate-H3 does not run."""

from __future__ import annotations

import dataclasses
import queue
import re

import numpy as np
import pytest
import torch
from realtime_recorder import Recorder

from h3serve.config.engine_config import EngineConfig
from h3serve.config_checks import check_config
from h3serve.errors import ConfigError
from h3serve.media.raw import read_chunk
from h3serve.messages import (
    JobCancelled,
    RealtimeChunkReady,
    RealtimeEnded,
    RealtimeInteract,
    RealtimeOpen,
    RealtimeRead,
    RealtimeStop,
)
from h3serve.model.realtime.prompt import encode_prompt
from h3serve.rank.model_runner import ModelRunner
from h3serve.rank.realtime_loop import Boundary, Inbox, generate_offline, realtime_choice, run_session, spool_chunk
from h3serve.rules import realtime_geometry as rt
from h3serve.rules.request import GenerationRequest
from h3serve.rules.validate.realtime_plan import plan_realtime
from h3serve.tools.tiny.make_adapter import make_tiny_adapter


@pytest.fixture(scope="module")
def lora_dir(tmp_path_factory):
    return make_tiny_adapter(tmp_path_factory.mktemp("rt") / "taomate", "taomate")


@pytest.fixture(scope="module")
def engine(tiny_checkpoint, lora_dir):
    threads = torch.get_num_threads()
    yield ModelRunner(EngineConfig(model=tiny_checkpoint, threads=1, task_type="fl2va", realtime_lora=str(lora_dir)))
    torch.set_num_threads(threads)


def _plan(engine, prompt: str, seed: int, frames: int):
    return plan_realtime(prompt, 64, 64, seed, frames, defaults=engine.defaults)


class _Value:
    def __init__(self, value: int = 0):
        self.value = value


def test_the_offline_run_is_the_session_and_deterministic_per_seed(engine):
    plan = _plan(engine, "a drummer on a rooftop", 11, 200)
    assert plan.chunks == 8
    runs = [Recorder(), Recorder(), Recorder()]
    generate_offline(engine, plan, runs[0])
    generate_offline(engine, plan, runs[1])
    generate_offline(engine, dataclasses.replace(plan, seed=12, chunks=4), runs[2])
    (frames, audio), (again, again_audio), (other, _) = (run.arrays() for run in runs)
    assert frames.shape == (rt.session_frames(8), 64, 64, 3) and audio.shape == (rt.samples_at(243), 2)
    np.testing.assert_array_equal(frames, again)
    np.testing.assert_array_equal(audio, again_audio)
    assert not np.array_equal(other[:34], frames[:34])
    assert engine.lora.active["transformer"] is None  # the LoRA is off again for the next job


def test_an_interaction_reaches_the_dit_from_the_next_chunk_boundary(engine, tmp_path):
    """Prompts B and then C arrive while chunk 1 is generated: C wins at boundary 2 (B is completed unstarted);
    chunk 2's student forwards read C's text states, chunks 0-1 A's."""
    components, dit = engine.pipeline.components, engine.pipeline.components.transformer
    prompts = {"A": "a calm lake at dawn", "B": "a storm", "C": "a desert caravan under stars"}
    states = {k: encode_prompt(components, v).states for k, v in prompts.items()}
    refined = {}
    with torch.no_grad():
        engine.lora.activate("transformer", realtime_choice(engine.config))
        refined = {k: dit.embed_text(v) for k, v in states.items()}
        engine.lora.activate("transformer", None)
    seen: list[str] = []
    handle = dit.register_forward_pre_hook(lambda _m, args: seen.append(next(
        (k for k, v in refined.items() if args[2].shape == v.shape and torch.equal(args[2], v)), "other")))
    requests, events = queue.Queue(), []
    job = RealtimeOpen(1, _plan(engine, prompts["A"], 5, 124), str(tmp_path))
    inbox = Inbox(requests, 1, _Value())
    boundaries = 0

    def decide() -> Boundary:
        nonlocal boundaries
        boundaries += 1
        if boundaries > 1:
            requests.put(RealtimeRead(1, boundaries - 2))  # the parent keeps up
        boundary = inbox.boundary()
        if boundaries == 2:  # while chunk 1 is generated, two interactions (and another session's) arrive
            requests.put(RealtimeInteract(1, prompts["B"], "b"))
            requests.put(RealtimeInteract(1, prompts["C"], "c"))
            requests.put(RealtimeInteract(9, prompts["B"], "stale"))
        if boundaries == 3:
            requests.put(RealtimeStop(1))
        return boundary

    try:
        end = run_session(engine, job, 0, 1, decide, spool_chunk(job, events.append), events.append)
    finally:
        handle.remove()
    student = [name for name in seen if name != "other"]  # the teacher reads the base model's refined text
    assert student == ["A"] * 8 + ["C"] * 4
    ready = [e for e in events if isinstance(e, RealtimeChunkReady)]
    assert [e.index for e in ready] == [0, 1, 2]
    assert [(e.started_event_ids, e.completed_event_ids) for e in ready] == [((), ()), ((), ()), (("c",), ("b", "c"))]
    assert end.stop and events[-1] == RealtimeEnded(1, 3, stopped=True)
    frames, audio = read_chunk(ready[2].path)
    assert frames.shape == (34, 64, 64, 3) and audio.shape == (rt.samples_at(102) - rt.samples_at(68), 2)


def test_a_cancel_ends_the_session_at_the_next_boundary(engine, tmp_path):
    events, cancel = [], _Value()
    job = RealtimeOpen(4, _plan(engine, "rain", 1, 500), str(tmp_path))
    inbox = Inbox(queue.Queue(), 4, cancel)

    def decide() -> Boundary:
        if len([e for e in events if isinstance(e, RealtimeChunkReady)]) == 1:
            cancel.value = 4
        return inbox.boundary()

    end = run_session(engine, job, 0, 1, decide, spool_chunk(job, events.append), events.append)
    assert end.cancel and events[-1] == JobCancelled(4) and len(events) == 2


@pytest.mark.parametrize("flags, says", [
    ({"tensor_parallel_size": 2, "num_ranks": 2}, "pure Ulysses sequence parallelism"),
    ({"ring_degree": 2}, "use --usp, not --ring"),
    ({"task_type": "ref2va"}, "run on the FL2VA (T2VA) DiT"),
    ({"cache_backend": "cache_dit"}, "drop --cache-backend"),
    ({"max_lora_rank": 2}, "smaller than the real-time LoRA's rank 4"),
])
def test_configurations_taomate_does_not_run_are_refused(tiny_checkpoint, lora_dir, flags, says):
    with pytest.raises(ConfigError, match=re.escape(says)):
        check_config(EngineConfig(model=tiny_checkpoint, realtime_lora=str(lora_dir), **flags))


def test_a_directory_that_is_not_the_streaming_lora_is_refused(tiny_checkpoint, tmp_path):
    with pytest.raises(ConfigError, match="--realtime-lora x: x: a TaoMate-H3 LoRA is a directory"):
        check_config(EngineConfig(model=tiny_checkpoint, realtime_lora=str(tmp_path / "x")))


@pytest.mark.slow
def test_sessions_and_jobs_reuse_the_compiled_blocks(tiny_checkpoint, lora_dir):
    """Regional compilation (Dynamo capture only): a session installs the same causal attention every time and gives
    the blocks their own back, so after the first session and job no graph is built again."""
    threads = torch.get_num_threads()
    try:
        engine = ModelRunner(EngineConfig(model=tiny_checkpoint, threads=1, task_type="fl2va",
                                          realtime_lora=str(lora_dir), compile_granularity="regional",
                                          compile_backend="aot_eager"))
        plan, job = _plan(engine, "x", 1, 100), engine.plan(GenerationRequest(prompt="x", steps=2, duration_s=4))
        graphs = []
        for _ in range(2):
            generate_offline(engine, plan, Recorder())
            engine.generate(job)
            graphs.append(engine.counters()["compiled_graphs"])
    finally:
        torch.set_num_threads(threads)
    assert graphs[0] > 0 and graphs[1] == graphs[0]


class _RssProbe:
    """A writer that keeps nothing, only this process' resident memory after each chunk (MiB)."""

    def __init__(self):
        self.rss: list[float] = []

    def segment(self, frames: np.ndarray, audio: np.ndarray) -> bytes:
        with open("/proc/self/status") as status:
            kib = next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))
        self.rss.append(kib / 1024)
        return b""

    def finish(self) -> bytes:
        return b""


@pytest.mark.slow
def test_a_five_minute_session_keeps_its_memory_flat(engine):
    """244 chunks (61 requests, five audio resets): the cache stays at its bound (tested per chunk in
    tests/model/realtime), the decoders keep bounded windows, nothing accumulates."""
    probe = _RssProbe()
    plan = _plan(engine, "a long walk through a forest", 2, 5 * 60 * 24)
    assert generate_offline(engine, plan, probe) == plan.chunks == 244
    settled = probe.rss[40]  # after the first requests: allocator pools and caches warm
    assert max(probe.rss[40:]) - settled < 24, (settled, max(probe.rss[40:]), probe.rss[-1])
