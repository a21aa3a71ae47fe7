"""Joining a rank's process group, and running one function on N fresh rank processes.

`join_group` is how every rank process meets its peers: the executor's long-lived engine ranks
(h3serve.rank.worker) and the short-lived ranks of `run_on_ranks`, which runs one function on N spawned
processes (NCCL, one GPU each; gloo on CPU) and returns what each returned: the selftest's multi-GPU checks
and the multi-rank tests use it.
"""

from __future__ import annotations

import io
import os
import queue
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from h3serve.errors import ServerError
from h3serve.parallel.rendezvous import Rendezvous, rank_environment
from h3serve.parallel.start_method import rank_context, start_rank


def process_group_options(cuda: bool) -> dict:
    """The backend, and on CUDA the rank's device (`torch.cuda.set_device` already ran): with `device_id`, NCCL
    builds its communicators eagerly at `init_process_group` and `new_group`, not lazily inside the first
    request's denoise."""
    if not cuda:
        return {"backend": "gloo"}
    return {"backend": "nccl", "device_id": torch.device("cuda", torch.cuda.current_device())}


def join_group(rank: int, world: int, init_method: str, cuda: bool, timeout: timedelta | None) -> None:
    """`init_process_group` for one rank on h3serve's own rendezvous (on CUDA, after `set_device`)."""
    rank_environment(os.environ, init_method)
    dist.init_process_group(
        init_method=init_method, rank=rank, world_size=world, timeout=timeout, **process_group_options(cuda)
    )


class RankFailure(ServerError, RuntimeError):
    """A rank of `run_on_ranks` raised, died or did not answer in time; `details` holds its traceback."""

    code = "rank_failed"

    def __init__(self, rank: int | None, details: str):
        who = "a rank" if rank is None else f"rank {rank}"
        super().__init__(f"{who} failed:\n{details}")
        self.rank, self.details = rank, details

    @property
    def last_line(self) -> str:
        """The exception line of the traceback (or the whole reason when there is none)."""
        lines = [line for line in self.details.strip().splitlines() if line.strip()]
        return lines[-1] if lines else "no report"


def _rank_main(
    rank: int,
    world: int,
    init_method: str,
    cuda: bool,
    threads: int | None,
    collective_s: float,
    target: Callable,
    args: tuple,
    results,
) -> None:
    try:
        if threads:
            torch.set_num_threads(threads)
        if cuda:  # before any CUDA work: NCCL and every allocation of this rank go to its own GPU
            torch.cuda.set_device(rank)
        join_group(rank, world, init_method, cuda, timedelta(seconds=collective_s))  # a bug fails, not hangs
        value = target(rank, world, *args)
        # Serialised to bytes: a tensor put on a queue as-is is shared through its sender's file descriptors,
        # which vanish once the rank exits.
        buffer = io.BytesIO()
        torch.save(value, buffer)
        results.put(("done", rank, buffer.getvalue()))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        results.put(("error", rank, traceback.format_exc()))
        raise


def run_on_ranks(
    world: int,
    target: Callable,
    *args: Any,
    cuda: bool = False,
    threads: int | None = None,
    timeout_s: float = 300.0,
    collective_s: float = 180.0,
) -> list[Any]:
    """`target(rank, world, *args)` on `world` spawned ranks (rank r on GPU r with `cuda`); the values by rank.

    `target` must be importable by name (spawned processes unpickle it). Raises `RankFailure` with the first
    failing rank's traceback, or when a rank dies without a report or the whole run exceeds `timeout_s`; the
    other ranks are then killed (they would wait in a collective their peer never joins)."""
    ctx = rank_context()
    results = ctx.Queue()
    init_method = Rendezvous.local().init_method
    procs = [
        start_rank(ctx, _rank_main, (rank, world, init_method, cuda, threads, collective_s, target, args, results))
        for rank in range(world)
    ]
    values: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(values) < world:
            try:
                kind, rank, value = results.get(timeout=1.0)
            except queue.Empty:
                dead = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0) and i not in values]
                if dead:
                    raise RankFailure(dead[0], f"exited with code {procs[dead[0]].exitcode} without a report") from None
                if time.monotonic() > deadline:
                    raise RankFailure(None, f"no answer within {timeout_s:g} s") from None
                continue
            if kind == "error":
                raise RankFailure(rank, value)
            values[rank] = torch.load(io.BytesIO(value), weights_only=False)
        for p in procs:
            p.join(timeout=60)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    return [values[r] for r in range(world)]
