"""The executor with several ranks: a killed rank fails its request and the ranks restart; two "nodes" meet
through an explicit rendezvous (what torchrun's environment describes) and give the single-node result."""

from __future__ import annotations

import os
import signal
import threading

import numpy as np
import pytest
from rank_sessions import PROMPT, plan_for

from h3serve.config.engine_config import EngineConfig
from h3serve.engine.executor import EngineError, Executor
from h3serve.parallel.rendezvous import Rendezvous, free_port

pytestmark = pytest.mark.slow


def _config(checkpoint) -> EngineConfig:
    return EngineConfig(model=checkpoint, threads=1, task_type="fl2va", ulysses_degree=2)


@pytest.fixture(scope="module")
def executor(parallel_checkpoint):
    ex = Executor(_config(parallel_checkpoint))
    yield ex
    ex.close()


@pytest.fixture(scope="module")
def single_node_output(executor):
    return executor.generate(plan_for(executor.defaults))


def test_killed_rank_fails_request_then_recovers(executor, single_node_output):
    assert len(executor.pids()) == 2
    victim = executor.pids()[1]

    def kill_on_first_step(done: int, total: int) -> None:
        if done == 1:
            os.kill(victim, signal.SIGKILL)

    with pytest.raises(EngineError, match="rank 1 exited with code -9 while the request was running"):
        executor.generate(plan_for(executor.defaults), on_progress=kill_on_first_step)
    assert executor.restarts == 1 and executor.alive() and victim not in executor.pids()
    again = executor.generate(plan_for(executor.defaults))
    np.testing.assert_array_equal(again.video, single_node_output.video)
    np.testing.assert_array_equal(again.audio, single_node_output.audio)


def test_a_cancelled_job_stops_every_rank_at_one_step_and_the_ranks_serve_on(executor, single_node_output):
    """The ranks vote on cancellation one step behind rank 0 (no per-step device drain): they still leave the
    job at the same step, so no collective is left unpaired and the next job runs on the same ranks."""
    from h3serve.engine.executor import Cancelled
    from h3serve.rules.request import GenerationRequest
    from h3serve.rules.validate import validate

    restarts, handle, seen = executor.restarts, {}, []
    plan = validate(GenerationRequest(prompt=PROMPT, steps=12, seed=1, duration_s=4), executor.defaults)

    def cancel_on_first_step(done: int, total: int) -> None:
        seen.append(done)
        executor.cancel(handle["seq"])

    with pytest.raises(Cancelled, match="was cancelled$"):
        executor.generate(plan, on_progress=cancel_on_first_step, on_start=lambda seq: handle.update(seq=seq))
    assert seen and max(seen) < 12 and executor.restarts == restarts
    again = executor.generate(plan_for(executor.defaults))
    assert executor.restarts == restarts
    np.testing.assert_array_equal(again.video, single_node_output.video)


def test_two_nodes_through_rendezvous_match_one_node(parallel_checkpoint, single_node_output):
    init = f"tcp://127.0.0.1:{free_port()}"
    follower = Executor(_config(parallel_checkpoint), rendezvous=Rendezvous(init, node_rank=1, nnodes=2))
    watcher = threading.Thread(target=follower.run_follower, kwargs={"poll_s": 0.2}, daemon=True)
    watcher.start()
    leader = Executor(_config(parallel_checkpoint), rendezvous=Rendezvous(init, node_rank=0, nnodes=2))
    try:
        assert len(leader.pids()) == len(follower.pids()) == 1
        out = leader.generate(plan_for(leader.defaults))
    finally:
        leader.close()  # rank 0 tells every rank to stop, so the follower's rank exits cleanly
        watcher.join(timeout=60)
        follower.close()
    assert not watcher.is_alive() and follower.restarts == 0
    np.testing.assert_array_equal(out.video, single_node_output.video)
    np.testing.assert_array_equal(out.audio, single_node_output.audio)


def test_idle_ranks_outlive_the_collective_timeout(parallel_checkpoint, single_node_output):
    """Ranks wait for the next job inside a broadcast: keepalives keep an idle engine under the group timeout."""
    import dataclasses
    import time

    config = dataclasses.replace(_config(parallel_checkpoint), collective_timeout_s=4.0, idle_keepalive_s=0.5)
    ex = Executor(config)
    try:
        time.sleep(6)  # idle for longer than the process group's timeout
        assert ex.alive()
        out = ex.generate(plan_for(ex.defaults))
        assert ex.restarts == 0
        np.testing.assert_array_equal(out.video, single_node_output.video)
    finally:
        ex.close()
