"""Ring attention: every rank keeps its queries and passes its key/value block around the ring.

Each step attends the local queries to one key/value block and folds the result into a running
(output, log-sum-exp) pair with the online-softmax merge, which is exact. Padding keys are never
attended: the caller says how many leading keys of each block are real (padding sits at the end of the
packed sequence, so a block's real keys are always a prefix), and an all-padding block is skipped.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from h3serve.accel.attention import PartialFn
from h3serve.accel.compile import count_collective


def merge_partial(
    acc: tuple[torch.Tensor, torch.Tensor] | None, out: torch.Tensor, lse: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Online-softmax merge of two partial attentions over disjoint key sets (fp32 accumulator)."""
    out = out.float()
    if acc is None:
        return out, lse
    acc_out, acc_lse = acc
    new_lse = torch.logaddexp(acc_lse, lse)
    merged = acc_out * torch.exp(acc_lse - new_lse)[..., None] + out * torch.exp(lse - new_lse)[..., None]
    return merged, new_lse


def post_exchange(
    send: torch.Tensor, recv: torch.Tensor, send_to: int, recv_from: int, group: ProcessGroup | None
) -> list[dist.Work]:
    """One ring step: post the send of `send` to global rank `send_to` and the receive of `recv` from `recv_from`;
    the caller waits on the returned works."""
    count_collective()
    ops = [dist.P2POp(dist.isend, send, send_to, group), dist.P2POp(dist.irecv, recv, recv_from, group)]
    return dist.batch_isend_irecv(ops)


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: ProcessGroup,
    valid_keys: Callable[[int], int],
    partial: PartialFn,
) -> torch.Tensor:
    """q, k, v [B, H, S_block, D] (this rank's block) -> attention over all blocks' real keys, [B, H, S_block, D].

    `valid_keys(source_rank)` is how many leading keys of the block owned by ring rank `source_rank` are real;
    `partial` is the attention backend's kernel with log-sum-exp (h3serve.accel.attention).
    """
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    send_to = dist.get_global_rank(group, (rank + 1) % size)
    recv_from = dist.get_global_rank(group, (rank - 1) % size)
    kv = torch.stack([k, v]).contiguous()  # one message per step instead of two
    spare = torch.empty_like(kv)
    acc = None
    for step in range(size):
        pending = []
        if step < size - 1:
            # Post the next exchange before computing, so the transfer overlaps this step's attention. Every
            # rank posts one send and one receive per step, in the same order, so the ring cannot deadlock.
            pending = post_exchange(kv, spare, send_to, recv_from, group)
        n = valid_keys((rank - step) % size)
        if n > 0:
            acc = merge_partial(acc, *partial(q, kv[0, :, :, :n], kv[1, :, :, :n]))
        for req in pending:
            req.wait()
        if pending:
            kv, spare = spare, kv  # the block just sent is free again: it receives the next one
    if acc is None:  # cannot happen for a non-empty sequence: the first block always holds real keys
        raise RuntimeError("ring attention: no real keys in any block")
    return acc[0].to(q.dtype)


