"""Run a function on N spawned gloo ranks (1 CPU thread each) and collect what every rank returns."""

from __future__ import annotations

import datetime
import io
import multiprocessing as mp
import queue
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from h3serve.parallel.rendezvous import free_port


def _rank_main(rank: int, world: int, port: int, target: Callable, args: tuple, results) -> None:
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=180),  # a bug fails the test instead of hanging it
        )
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


def run_ranks(world: int, target: Callable, *args: Any, timeout_s: float = 300.0) -> list[Any]:
    """`target(rank, world, *args)` on `world` ranks; returns the values by rank, or fails with a rank's traceback."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_rank_main, args=(rank, world, port, target, args, results), daemon=True)
        for rank in range(world)
    ]
    for p in procs:
        p.start()
    values: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(values) < world:
            try:
                kind, rank, value = results.get(timeout=1.0)
            except queue.Empty:
                dead = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0) and i not in values]
                if dead or time.monotonic() > deadline:
                    raise AssertionError(f"ranks {dead or 'all'} failed or timed out without a report") from None
                continue
            if kind == "error":
                raise AssertionError(f"rank {rank} failed:\n{value}")
            values[rank] = torch.load(io.BytesIO(value), weights_only=False)
        for p in procs:
            p.join(timeout=60)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    return [values[r] for r in range(world)]
