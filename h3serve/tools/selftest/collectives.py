"""NCCL collectives across the visible GPUs, one process per GPU: all-reduce (TP), all-to-all (Ulysses) and
all-gather (DLO, Ring's exchange is point-to-point of the same size), timed with bus bandwidth (nccl-tests'
definition: all-reduce 2(n-1)/n, the others (n-1)/n of the message per rank)."""

from __future__ import annotations

import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

MESSAGE_BYTES = 256 * 2**20


def _rank(rank: int, world: int, port: int, out) -> None:
    import os

    from h3serve.parallel.rendezvous import rank_environment
    from h3serve.rank.worker import process_group_options

    torch.cuda.set_device(rank)
    rank_environment(os.environ)  # the engine's own start-up path: torchrun's agent store dropped, device_id given
    dist.init_process_group(init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60), **process_group_options(cuda=True))
    n = MESSAGE_BYTES // 2
    x = torch.ones(n, dtype=torch.bfloat16, device="cuda")
    y = torch.empty_like(x)
    gathered = torch.empty(n * world, dtype=torch.bfloat16, device="cuda")
    ops = {
        "all_reduce": (lambda: dist.all_reduce(x), 2 * (world - 1) / world),
        "all_to_all": (lambda: dist.all_to_all_single(y, x), (world - 1) / world),
        "all_gather": (lambda: dist.all_gather_into_tensor(gathered, x), (world - 1) / world),
    }
    results = {}
    for name, (op, factor) in ops.items():
        op()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(5):
            op()
        torch.cuda.synchronize()
        seconds = (time.perf_counter() - start) / 5
        results[name] = MESSAGE_BYTES * factor / seconds / 1e9
    x.fill_(rank + 1)
    dist.all_reduce(x)
    results["sum_ok"] = float(x[0]) == world * (world + 1) / 2
    if rank == 0:
        out.put(results)
    dist.destroy_process_group()


def run_collectives(world: int, timeout_s: float) -> dict[str, float]:
    from h3serve.parallel.rendezvous import free_port

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, world, port, out)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        results = out.get(timeout=timeout_s)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()
    if not results.pop("sum_ok"):
        from h3serve.tools.selftest.core import Failed

        raise Failed("NCCL all-reduce returned a wrong sum; check the NCCL install / P2P settings (NCCL_P2P_DISABLE)")
    return results
