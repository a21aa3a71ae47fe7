"""One rank process: load the model once, then run every job the executor sends.

Rank 0 talks to the parent (queues); all ranks agree on each job and on cancellation through
`torch.distributed` broadcasts, so every rank leaves a request at the same step and no collective hangs.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import threading
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import NoReturn

import torch
import torch.distributed as dist

from h3serve.config import EngineConfig
from h3serve.engine.messages import Done, Failed, Fatal, JobCancelled, Progress, RankJob, Ready, Stop
from h3serve.errors import ConfigError, job_error_for
from h3serve.parallel.launch import join_group
from h3serve.rank.startup import check_engine

REFUSAL_GRACE_S = 10.0  # a rank other than 0 waits this long on a refused flag before it exits


class _CancelledHere(Exception):
    pass


def _broadcast_object(obj, rank: int, world: int):
    if world == 1:
        return obj
    box = [obj if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _cancel_requested(cancel_value, seq: int, rank: int, world: int, device: torch.device) -> bool:
    """Rank 0 reads the shared flag; the decision is broadcast so that every rank stops at the same step.

    One rank decides alone: no device tensor, no host<->device round trip and synchronisation per step."""
    requested = rank == 0 and cancel_value.value == seq
    if world == 1:
        return requested
    flag = torch.tensor([int(requested)], device=device)
    dist.broadcast(flag, src=0)
    return bool(flag.item())


def _failed(seq: int, e: Exception, rank: int | None, prefix: str = "") -> Failed:
    """What a client may read about a failure: request/media errors say what is wrong with the input; anything
    else is summarised by its type only (the traceback, with its internal paths, goes to the server log)."""
    failure = job_error_for(e)
    message = str(e) if failure.client else f"internal error during generation ({type(e).__name__}); see the server log"
    return Failed(seq, prefix + message, rank, failure.client, failure.code)


_KEEPALIVE = "keepalive"


def _next_job(requests, rank: int, world: int, keepalive_s: float) -> RankJob | Stop:
    """Rank 0 takes the next job from the parent; every rank gets it by broadcast.

    While idle, rank 0 broadcasts a keepalive every `keepalive_s`: the other ranks wait for the next job inside
    a collective, which would otherwise hit the process group's timeout (30 min on gloo, 10 on NCCL) on a quiet
    server and take the engine down.
    """
    while True:
        item = None
        if rank == 0:
            try:
                item = requests.get(timeout=keepalive_s if world > 1 else None)
            except queue.Empty:
                item = _KEEPALIVE
        item = _broadcast_object(item, rank, world)
        if not (isinstance(item, str) and item == _KEEPALIVE):
            return item


def _exit_with_parent() -> None:
    """End this rank when the process that spawned it dies (even by SIGKILL).

    A rank holds both ends of its request queue's pipe, so it would never see end-of-file and would keep
    the model (and its GPU memory) loaded forever as an orphan, starving a restarted server.
    """
    parent = mp.parent_process()
    if parent is None:
        return

    def watch() -> None:
        parent.join()  # waits on the parent's sentinel: returns when the parent is gone
        os._exit(1)

    threading.Thread(target=watch, name="h3serve-parent-watch", daemon=True).start()


def _refuse(error: ConfigError, rank: int, events) -> NoReturn:
    """End this rank on a refused flag. Rank 0 reports it; every rank refuses the same flags, so the others wait
    a moment before they exit, or the parent could see their exit before rank 0's report."""
    if rank == 0:
        events.put(Fatal(str(error), config_error=True))
    else:
        time.sleep(REFUSAL_GRACE_S)
    raise SystemExit(1) from None


def _start(rank: int, world: int, init_method: str, config: EngineConfig, events, local_rank: int | None):
    """This rank's `LocalEngine`: the flags' torch checks, its GPU, the process group, the weights. A rank that
    cannot start exits, after rank 0 reported why (the parent turns the report into a start-up error)."""
    from h3serve.rank.local import LocalEngine

    try:  # before any CUDA work: the flags only torch can check
        setup = check_engine(config)
    except ConfigError as e:
        _refuse(e, rank, events)
    try:
        cuda = setup.device.type == "cuda"
        if cuda and (world > 1 or local_rank):  # before any CUDA work: NCCL and every allocation of this rank
            torch.cuda.set_device(rank if local_rank is None else local_rank)  # go to its own GPU (replica slice)
        if world > 1:
            timeout = None if config.collective_timeout_s is None else timedelta(seconds=config.collective_timeout_s)
            join_group(rank, world, init_method, cuda, timeout)
        return LocalEngine(config, rank=rank, world_size=world, setup=setup)
    except Exception as e:
        if rank == 0:
            events.put(Fatal(f"{type(e).__name__}: {e}"))
        raise SystemExit(1) from None


def _run_job(engine, job: RankJob, rank: int, world: int, events, cancel_value, comm_device: torch.device) -> None:
    """One job on this rank; rank 0 reports its progress and its outcome."""
    from h3serve.engine.stream_output import DiscardSink, Mp4Sink
    from h3serve.media.raw import write_raw

    def on_step(done: int, total: int) -> None:
        if rank == 0:
            events.put(Progress(job.seq, done, total))
        if _cancel_requested(cancel_value, job.seq, rank, world, comm_device):
            raise _CancelledHere

    sink = None
    if job.encoder is not None:  # streamed: rank 0 writes the MP4; the others decode their tiles in step
        mp4 = Path(job.spool).with_suffix(".mp4")
        sink = Mp4Sink(mp4, job.encoder, previews=True) if rank == 0 else DiscardSink()
    try:
        output = engine.generate(job.plan, on_step, sink)
    except _CancelledHere:
        if rank == 0:
            events.put(JobCancelled(job.seq))
        return
    except Exception as e:
        traceback.print_exc()
        if world > 1:
            # Another rank may be waiting in a collective this rank will never join: continuing would
            # deadlock or pair up mismatched collectives. Report, then exit; the executor restarts all ranks.
            events.put(_failed(job.seq, e, rank, prefix=f"rank {rank}: "))
            events.close()
            events.join_thread()  # flush the report before the hard exit
            os._exit(1)
        events.put(_failed(job.seq, e, None))
        return
    if rank == 0 and isinstance(sink, Mp4Sink):
        durations, peak = output.stage_durations, output.peak_memory_mb
        events.put(Done(job.seq, durations, peak, sink.files(), output.num_frames, output.counters))
    elif rank == 0:
        write_raw(job.spool, output.video, output.audio)
        events.put(Done(job.seq, output.stage_durations, output.peak_memory_mb, counters=output.counters))


def worker_main(
    rank: int,
    world: int,
    init_method: str,
    config: EngineConfig,
    requests,
    events,
    cancel_value,
    local_rank: int | None = None,
) -> None:
    """Entry point of a rank process (spawned by `Executor`). `local_rank` picks the GPU on this node."""
    _exit_with_parent()
    engine = _start(rank, world, init_method, config, events, local_rank)
    comm_device = engine.device if engine.device.type == "cuda" else torch.device("cpu")
    if rank == 0:
        events.put(Ready(engine.defaults, engine.tasks))
    while True:
        job = _next_job(requests, rank, world, config.idle_keepalive_s)
        if isinstance(job, Stop):
            break
        _run_job(engine, job, rank, world, events, cancel_value, comm_device)
    if world > 1:
        dist.destroy_process_group()
    os._exit(0)
