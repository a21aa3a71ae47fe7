"""One rank process: load the model once, then run every job the executor sends.

Rank 0 talks to the parent (queues); all ranks agree on each job and on cancellation through
`torch.distributed` broadcasts, so every rank leaves a request at the same step and no collective hangs.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import sys
import threading
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import NoReturn

import torch
import torch.distributed as dist

from h3serve.config.engine_config import EngineConfig
from h3serve.errors import ConfigError, is_client_error, job_error_for
from h3serve.messages import (
    Done,
    Fatal,
    JobCancelled,
    JobFailed,
    JobProgress,
    RankJob,
    Ready,
    RealtimeInteract,
    RealtimeOpen,
    RealtimeRead,
    RealtimeStop,
    Stop,
)
from h3serve.parallel.launch import join_group
from h3serve.parallel.peers import Peers, is_lost_connection
from h3serve.rank.device_checks import check_engine
from h3serve.rank.model_runner import ModelRunner
from h3serve.rank.realtime_loop import Inbox, run_session, spool_chunk
from h3serve.rank.warmup import warm_up

REFUSAL_GRACE_S = 10.0  # a rank other than 0 waits this long on a refused flag before it exits


class _CancelledHere(Exception):
    pass


def _broadcast_object(obj, rank: int, world: int):
    if world == 1:
        return obj
    box = [obj if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


class CancelVote:
    """Whether the ranks stop job `seq` now: rank 0 reads the parent's shared flag, every rank obeys its decision.

    One rank decides alone. With several, rank 0's decision at step i is broadcast at step i and obeyed by every
    rank at step i + 1 (so all stop at the same step, one step after rank 0 saw the flag): a step never waits
    for its own broadcast. On CUDA the broadcast lands in pinned host memory behind an event that the next step
    waits for, so the host stays at most one step ahead of the device instead of draining it every step (the
    old `.item()` emptied the device's queue before the next step could be enqueued)."""

    def __init__(self, cancel_value, seq: int, rank: int, world: int, device: torch.device):
        self.cancel_value, self.seq, self.rank, self.world, self.device = cancel_value, seq, rank, world, device
        self.pending: tuple[torch.Tensor, torch.cuda.Event | None] | None = None

    def __call__(self) -> bool:
        requested = self.rank == 0 and self.cancel_value.value == self.seq
        if self.world == 1:
            return requested
        decided = self._collect()
        self._post(requested)
        return decided

    def _post(self, requested: bool) -> None:
        """Broadcast rank 0's decision on the communication device; no host<->device synchronisation."""
        flag = torch.full((1,), int(requested), dtype=torch.int32, device=self.device)  # a fill: no upload
        dist.broadcast(flag, src=0)
        if self.device.type != "cuda":
            self.pending = (flag, None)
            return
        host = flag.to("cpu", non_blocking=True)  # into pinned memory, queued after the broadcast
        ready = torch.cuda.Event(blocking=True)  # the wait sleeps instead of spinning a core
        ready.record()
        self.pending = (host, ready)

    def _collect(self) -> bool:
        """The previous step's decision (False at the first step): its copy finished long ago, as a rule."""
        if self.pending is None:
            return False
        host, ready = self.pending
        self.pending = None
        if ready is not None:
            ready.synchronize()
        return bool(host[0])


def _failed(seq: int, e: Exception, rank: int | None, prefix: str = "", peers: Peers | None = None) -> JobFailed:
    """What a client may read about a failure: request/media errors say what is wrong with the input; a collective
    that lost a peer names the rank and node it lost; anything else is summarised by its type only (the
    traceback, with its internal paths and addresses, goes to the server log)."""
    failure = job_error_for(e)
    if peers is not None and rank is not None and is_lost_connection(e):
        return JobFailed(seq, peers.describe_loss(e, rank), rank, False, failure.code)
    message = str(e) if failure.client else f"internal error during generation ({type(e).__name__}); see the server log"
    return JobFailed(seq, prefix + message, rank, failure.client, failure.code)


def _log_failure(e: Exception) -> None:
    """A failed job in the rank's log: the request's fault (bad media, a rule) in one line, anything else with its
    traceback."""
    if is_client_error(e):
        print(f"request refused: {e}", file=sys.stderr)
    else:
        traceback.print_exc()


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


def rank_gpu(device: torch.device, rank: int, world: int, local_rank: int | None) -> int | None:
    """The GPU this rank process works on (None off CUDA): its local rank (a replica's slice of the node), else
    its rank in a multi-rank group, else the N of a single rank's `--device cuda:N` (0 for plain `cuda`).
    Without setting it, a single rank on cuda:N would open a stray context on GPU 0 and register its pinned
    host memory against device 0."""
    if device.type != "cuda":
        return None
    if local_rank is not None:
        return local_rank
    return rank if world > 1 else device.index or 0


def _start(
    rank: int, world: int, init_method: str, config: EngineConfig, events, local_rank: int | None
) -> tuple[ModelRunner, Peers | None]:
    """This rank's `ModelRunner`: the flags' torch checks, its GPU, the process group and where every rank runs
    (several ranks), the weights. A rank that cannot start exits, after rank 0 reported why (the parent turns the
    report into a start-up error)."""
    try:  # before any CUDA work: the flags only torch can check
        setup = check_engine(config)
    except ConfigError as e:
        _refuse(e, rank, events)
    try:
        cuda = setup.device.type == "cuda"
        gpu = rank_gpu(setup.device, rank, world, local_rank)
        if gpu is not None:  # before any CUDA work: NCCL, every allocation and pinned buffer go to this GPU
            torch.cuda.set_device(gpu)
        peers = None
        if world > 1:
            timeout = None if config.collective_timeout_s is None else timedelta(seconds=config.collective_timeout_s)
            join_group(rank, world, init_method, cuda, timeout)
            peers = Peers.gather(init_method, world)
        return ModelRunner(config, rank=rank, world_size=world, setup=setup), peers
    except Exception as e:
        if rank == 0:
            events.put(Fatal(f"{type(e).__name__}: {e}"))
        raise SystemExit(1) from None


def _warm(engine: ModelRunner, rank: int, events) -> None:
    """--warmup on every rank before rank 0 says Ready (h3serve.rank.warmup): the first request finds everything
    compiled, planned and allocated. A warm-up that fails ends the rank as a failed start-up would."""
    if not engine.config.warmup:
        return
    try:
        warm_up(engine, (lambda text: print(text, file=sys.stderr)) if rank == 0 else None)
    except Exception as e:
        traceback.print_exc()
        if rank == 0:
            events.put(Fatal(f"warm-up failed: {type(e).__name__}: {e}"))
        raise SystemExit(1) from None


def _run_job(
    engine, job: RankJob, rank: int, world: int, events, cancel_value, comm_device: torch.device, peers: Peers | None
) -> None:
    """One job on this rank; rank 0 reports its progress and its outcome."""
    from h3serve.media.raw import write_raw
    from h3serve.media.sink import DiscardSink, Mp4Sink

    cancelled = CancelVote(cancel_value, job.seq, rank, world, comm_device)

    def on_step(done: int, total: int) -> None:
        if rank == 0:
            events.put(JobProgress(job.seq, done, total))
        if cancelled():
            raise _CancelledHere

    sink = None
    if job.encoder is not None:  # streamed: rank 0 writes the MP4; the others decode their tiles in step
        mp4 = Path(job.spool).with_suffix(".mp4")
        sink = Mp4Sink(mp4, job.encoder, previews=True, batch_frames=job.plan.preencode_batch_frames,
                       device=engine.device) if rank == 0 else DiscardSink()
    try:
        output = engine.generate(job.plan, on_step, sink)
    except _CancelledHere:
        if rank == 0:
            events.put(JobCancelled(job.seq))
        return
    except Exception as e:
        _log_failure(e)
        if world > 1:
            # Another rank may be waiting in a collective this rank will never join: continuing would
            # deadlock or pair up mismatched collectives. Report, then exit; the executor restarts all ranks.
            events.put(_failed(job.seq, e, rank, prefix=f"rank {rank}: ", peers=peers))
            events.close()
            events.join_thread()  # flush the report before the hard exit
            os._exit(1)
        events.put(_failed(job.seq, e, None))
        return
    if rank == 0 and isinstance(sink, Mp4Sink):
        durations, peak = output.stage_durations, output.peak_memory_mb
        events.put(Done(job.seq, durations, peak, files=tuple(sink.outputs()), frames=output.num_frames,
                        counters=output.counters, stage_timeline=tuple(output.stage_timeline)))
    elif rank == 0:
        for index, media in enumerate(output.outputs):
            write_raw(job.spool_for(index), media.video, media.audio)
        events.put(Done(job.seq, output.stage_durations, output.peak_memory_mb, counters=output.counters,
                        outputs=len(output.outputs), stage_timeline=tuple(output.stage_timeline)))


def _run_realtime(
    engine, job: RealtimeOpen, rank: int, world: int, requests, events, cancel_value, peers: Peers | None
) -> bool:
    """A real-time session on this rank (h3serve.rank.realtime_loop); True when the parent asked the ranks to exit."""
    decide = Inbox(requests, job.seq, cancel_value).boundary if rank == 0 else None
    try:
        return run_session(engine, job, rank, world, decide, spool_chunk(job, events.put), events.put).exit
    except Exception as e:
        _log_failure(e)
        if world > 1:  # as in _run_job: a peer may wait in a collective this rank will never join
            events.put(_failed(job.seq, e, rank, prefix=f"rank {rank}: ", peers=peers))
            events.close()
            events.join_thread()
            os._exit(1)
        events.put(_failed(job.seq, e, None))
        return False


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
    engine, peers = _start(rank, world, init_method, config, events, local_rank)
    comm_device = engine.device if engine.device.type == "cuda" else torch.device("cpu")
    _warm(engine, rank, events)
    if rank == 0:
        events.put(Ready(engine.defaults, engine.tasks))
    while True:
        job = _next_job(requests, rank, world, config.idle_keepalive_s)
        if isinstance(job, Stop):
            break
        if isinstance(job, RealtimeInteract | RealtimeRead | RealtimeStop):
            continue  # a control message that reached a session's end too late
        if isinstance(job, RealtimeOpen):
            if _run_realtime(engine, job, rank, world, requests, events, cancel_value, peers):
                break
            continue
        _run_job(engine, job, rank, world, events, cancel_value, comm_device, peers)
    if world > 1:
        dist.destroy_process_group()
    os._exit(0)
