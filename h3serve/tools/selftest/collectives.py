"""The collectives of the parallel strategies at the sizes the engine issues them, run by the engine's own helpers
(h3serve.parallel.comm, the Ring exchange), each checked for the right values and timed with bus bandwidth
(nccl-tests' definition: all-reduce 2(n-1)/n of the message, all-to-all and all-gather (n-1)/n, a send/receive
step the message). Runs inside every rank of a selftest session (h3serve.tools.selftest.parallel_checks)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from h3serve.model.transformer import H3TransformerConfig
from h3serve.parallel.comm import HALF, all_reduce_wide, all_to_all, gather_into
from h3serve.parallel.ring import post_exchange
from h3serve.tools.bench.measure import sync

# op -> what issues it in the engine (the figure says it)
USES = {
    "all_reduce": "TP row-parallel output [S, hidden], summed in fp32",
    "all_to_all": "Ulysses q/k/v exchange [S/n, 3·hidden]",
    "ring_exchange": "Ring k/v block [2, S/n, hidden]",
    "all_gather": "sequence-parallel gather of the rows [S/n, hidden]",
}


def message_bytes(cfg: H3TransformerConfig, rows: int, world: int, dtype: torch.dtype) -> dict[str, int]:
    """Bytes of each rank's buffer per collective, as one DiT block issues it over `rows` packed rows with the
    whole `world` as the TP, Ulysses or Ring group."""
    es = torch.empty((), dtype=dtype).element_size()
    chunk = math.ceil(rows / world)  # the padded sequence chunk of a sequence-parallel rank
    reduce_es = 4 if dtype in HALF else es  # all_reduce_wide sums half-precision partials in fp32
    return {
        "all_reduce": rows * cfg.hidden_size * reduce_es,
        "all_to_all": chunk * 3 * cfg.inner_dim * es,
        "ring_exchange": 2 * chunk * cfg.inner_dim * es,
        "all_gather": chunk * cfg.hidden_size * es,
    }


def _seconds(op: Callable[[], object], device: torch.device, calls: int) -> float:
    op()  # warm-up (and, for NCCL, the first use of the algorithm)
    sync(device)
    start = time.perf_counter()
    for _ in range(calls):
        op()
    sync(device)
    return (time.perf_counter() - start) / calls


def _elements(nbytes: int, dtype: torch.dtype, multiple: int) -> int:
    es = torch.empty((), dtype=dtype).element_size()
    return max(multiple, nbytes // es // multiple * multiple)


def measure(
    rank: int, world: int, sizes: dict[str, int], dtype: torch.dtype, device: torch.device, calls: int
) -> dict[str, dict]:
    """Every collective of `sizes` on the whole group: {op: {bytes, seconds, busbw_gbps, ok}}; `ok` is whether the
    values that arrived are the ones sent (small integers, exact in every dtype used)."""
    group = dist.group.WORLD
    out: dict[str, tuple[bool, float, float, int]] = {}  # op -> (ok, seconds per call, bus factor, bytes)
    wide = torch.float32 if dtype in HALF else dtype
    x = torch.full((_elements(sizes["all_reduce"], wide, 1),), rank + 1.0, dtype=wide, device=device)
    ok = bool((all_reduce_wide(x, group) == world * (world + 1) / 2).all())
    out["all_reduce"] = (
        ok,
        _seconds(lambda: all_reduce_wide(x, group), device, calls),
        2 * (world - 1) / world,
        x.nbytes,
    )
    n = _elements(sizes["all_to_all"], dtype, world) // world
    send = (rank * world + torch.arange(world, device=device, dtype=dtype)).repeat_interleave(n).view(world, n)
    got = all_to_all(send, group)  # chunk j came from rank j, which sent it j·world + rank
    ok = bool((got == (torch.arange(world, device=device, dtype=dtype) * world + rank)[:, None]).all())
    out["all_to_all"] = (ok, _seconds(lambda: all_to_all(send, group), device, calls), (world - 1) / world, send.nbytes)
    kv = torch.full((_elements(sizes["ring_exchange"], dtype, 1),), float(rank), dtype=dtype, device=device)
    spare = torch.empty_like(kv)
    ahead, behind = (rank + 1) % world, (rank - 1) % world

    def exchange() -> None:
        for work in post_exchange(kv, spare, ahead, behind, group):
            work.wait()

    exchange()
    ok = bool((spare == behind).all())
    out["ring_exchange"] = (ok, _seconds(exchange, device, calls), 1.0, kv.nbytes)
    piece = torch.full((_elements(sizes["all_gather"], dtype, 1),), float(rank), dtype=dtype, device=device)
    gathered = torch.empty(world * piece.numel(), dtype=dtype, device=device)
    gather_into(gathered, piece, group)
    ok = bool((gathered.view(world, -1) == torch.arange(world, device=device, dtype=dtype)[:, None]).all())
    out["all_gather"] = (
        ok,
        _seconds(lambda: gather_into(gathered, piece, group), device, calls),
        world - 1.0,
        piece.nbytes,
    )
    return {
        op: {"bytes": nbytes, "seconds": seconds, "busbw_gbps": nbytes * factor / seconds / 1e9, "ok": ok}
        for op, (ok, seconds, factor, nbytes) in out.items()
    }
