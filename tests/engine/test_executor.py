"""The executor's rank processes: results, progress, cancellation, timeouts and recovery from a dead rank."""

from __future__ import annotations

import os
import signal

import numpy as np
import pytest
import torch

from h3serve.config.engine_config import EngineConfig
from h3serve.engine.executor import Cancelled, EngineError, Executor
from h3serve.parallel.start_method import START_ENV
from h3serve.rank.model_runner import ModelRunner
from h3serve.rules.request import GenerationRequest
from h3serve.rules.validate import validate


@pytest.fixture(scope="module")
def executor(tiny_checkpoint):
    ex = Executor(EngineConfig(model=tiny_checkpoint, threads=1))
    yield ex
    ex.close()


def _plan(ex, steps=2, seed=1):
    return validate(GenerationRequest(prompt="waves on a beach", steps=steps, seed=seed, duration_s=4), ex.defaults)


def test_result_equals_in_process_engine(executor, tiny_checkpoint):
    steps_seen = []
    out = executor.generate(_plan(executor), on_progress=lambda d, t: steps_seen.append((d, t)))
    assert steps_seen == [(1, 2), (2, 2)]
    assert out.video.shape == (107, 64, 128, 3) and out.video.dtype == np.float32
    assert out.audio.shape == (2, 178 * 800)
    assert {"text_encode", "denoise", "video_decode", "audio_decode"} <= set(out.stage_durations)
    # Same thread count: CPU reductions (the audio VAE convs) are only bit-stable at equal parallelism.
    threads = torch.get_num_threads()
    try:
        local = ModelRunner(EngineConfig(model=tiny_checkpoint, threads=1)).generate(_plan(executor))
    finally:
        torch.set_num_threads(threads)
    np.testing.assert_array_equal(out.video, local.video)
    np.testing.assert_array_equal(out.audio, local.audio)


def test_streamed_job_files_hold_the_full_decodes_bytes(executor, tmp_path):
    """Two outputs (seeds 1 and 2), spooled arrays and streamed files: every file of each output the same bytes
    both ways, and output 1 the single request at seed 2."""
    import dataclasses

    from h3serve.engine.artifacts import write_artifacts
    from h3serve.media.mp4 import EncoderOptions
    from h3serve.media.previews import VARIANTS, output_file_name

    fast = EncoderOptions(preset="ultrafast", threads=1)
    plan = dataclasses.replace(_plan(executor, steps=2), num_outputs=2)
    full = executor.generate(plan)
    streamed = executor.generate(plan, encoder=fast)  # rank 0 writes the files itself
    assert streamed.video is None and streamed.num_frames == 107 and set(streamed.files) == set(VARIANTS)
    assert len(full.outputs) == len(streamed.outputs) == 2
    np.testing.assert_array_equal(full.others[0].video, executor.generate(_plan(executor, seed=2)).video)
    write_artifacts(tmp_path / "full", full, fast)
    write_artifacts(tmp_path / "streamed", streamed, fast)
    for index in (0, 1):
        for variant in VARIANTS:
            name = output_file_name(variant, index)
            assert (tmp_path / "streamed" / name).read_bytes() == (tmp_path / "full" / name).read_bytes(), name
    assert (tmp_path / "full" / "1.video.mp4").read_bytes() != (tmp_path / "full" / "video.mp4").read_bytes()


def test_cancel_at_next_step(executor):
    handle = {}

    def on_progress(done, total):
        executor.cancel(handle["seq"])

    with pytest.raises(Cancelled):
        executor.generate(_plan(executor, steps=5), on_progress=on_progress, on_start=lambda s: handle.update(seq=s))
    assert executor.generate(_plan(executor, steps=1)).video.shape[0] == 107  # still serving


def test_timeout_aborts_the_job(executor):
    with pytest.raises(TimeoutError, match="timed out"):
        executor.generate(_plan(executor, steps=30), timeout_s=0.01)
    assert executor.alive()


def test_killed_rank_fails_request_then_recovers(executor):
    pid = executor.pids()[0]

    def kill_on_first_step(done, total):
        if done == 1:
            os.kill(pid, signal.SIGKILL)

    with pytest.raises(EngineError, match="rank 0 exited"):
        executor.generate(_plan(executor, steps=7), on_progress=kill_on_first_step)
    assert executor.restarts == 1 and executor.alive() and executor.pids()[0] != pid
    assert executor.generate(_plan(executor, steps=1)).audio.shape[0] == 2


_PARENT = r"""
import sys, time
from pathlib import Path
from h3serve.config.engine_config import EngineConfig
from h3serve.engine.executor import Executor
ex = Executor(EngineConfig(model=Path(sys.argv[1]), threads=1))
print("PIDS", *ex.pids(), flush=True)
time.sleep(600)
"""


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_ranks_exit_when_the_parent_is_killed(tiny_checkpoint):
    """A SIGKILLed server must not leave ranks holding the model (and a GPU) as orphans."""
    import subprocess
    import sys
    import time

    env = {**os.environ, START_ENV: "spawn"}  # the production default (the suite's fork server has its own test)
    parent = subprocess.Popen([sys.executable, "-c", _PARENT, str(tiny_checkpoint)], stdout=subprocess.PIPE, text=True,
                              env=env)
    pids = [int(p) for p in parent.stdout.readline().split()[1:]]
    assert pids and all(_running(p) for p in pids)
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + 15
    while any(_running(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_running(p) for p in pids)


def test_internal_errors_reach_the_client_without_internals(executor, tiny_checkpoint):
    import dataclasses

    broken = dataclasses.replace(_plan(executor, steps=1), width=80)  # bypasses validation: not a multiple of 32
    with pytest.raises(EngineError) as e:
        executor.generate(broken)
    assert str(e.value) == "internal error during generation (RuntimeError); see the server log"
    assert str(tiny_checkpoint) not in str(e.value) and "Traceback" not in str(e.value)
    assert executor.generate(_plan(executor, steps=1)).video.shape[0] == 107  # the engine keeps serving


def test_closed_executor_refuses_work_and_does_not_restart(tiny_checkpoint):
    ex = Executor(EngineConfig(model=tiny_checkpoint, threads=1))
    ex.close()
    assert not ex.alive()
    with pytest.raises(EngineError, match="shut down"):
        ex.generate(_plan(ex, steps=1))
    assert ex.restarts == 0 and not ex.alive()


def test_a_cancel_not_honoured_within_the_grace_restarts_the_ranks(executor):
    """A step that runs away (a huge request) cannot hold the engine: past the grace the ranks are restarted."""
    restarts, grace = executor.restarts, executor.cancel_grace_s
    executor.cancel_grace_s = 0.0  # no step ends within 0 s: the restart path, deterministically
    try:
        with pytest.raises(Cancelled, match="restarted"):
            executor.generate(_plan(executor, steps=30), on_start=executor.cancel)
    finally:
        executor.cancel_grace_s = grace
    assert executor.restarts == restarts + 1 and executor.alive()
    assert executor.generate(_plan(executor, steps=1)).video.shape[0] == 107


def test_stale_spool_folders_of_dead_servers_are_removed(tmp_path):
    from h3serve.engine.executor import SPOOL_PREFIX, remove_stale_spools

    dead = tmp_path / f"{SPOOL_PREFIX}999999999-abc"
    alive = tmp_path / f"{SPOOL_PREFIX}{os.getppid()}-abc"
    dead.mkdir()
    alive.mkdir()
    assert remove_stale_spools(tmp_path) == [dead]
    assert alive.exists() and not dead.exists()
