"""Ulysses (DeepSpeed-Ulysses) sequence parallelism: trade sequence shards for head shards around attention.

Before attention one all-to-all turns "my rows, all local heads" into "the group's rows, 1/U of the heads";
after attention the inverse all-to-all turns it back. Chunks are equal because the packed sequence is padded
to a multiple of the sequence-parallel degree, so the exchange is a plain `all_to_all_single`.
"""

from __future__ import annotations

import torch
from torch.distributed import ProcessGroup

from h3serve.parallel.comm import all_to_all, group_size


def scatter_heads(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """[B, c, H, D] (my rows) -> [B, U·c, H/U, D] (the group's rows in member order, my head slice)."""
    u = group_size(group)
    if u == 1:
        return x
    b, c, h, d = x.shape
    send = x.reshape(b, c, u, h // u, d).permute(2, 0, 1, 3, 4)  # [U (destination), B, c, H/U, D]
    recv = all_to_all(send, group)  # [U (source = sequence chunk), B, c, H/U, D]
    return recv.permute(1, 0, 2, 3, 4).reshape(b, u * c, h // u, d)


def gather_heads(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Inverse of `scatter_heads`: [B, U·c, H/U, D] -> [B, c, H, D]."""
    u = group_size(group)
    if u == 1:
        return x
    b, uc, hu, d = x.shape
    send = x.reshape(b, u, uc // u, hu, d).permute(1, 0, 2, 3, 4)  # [U (destination = chunk owner), B, c, H/U, D]
    recv = all_to_all(send, group)  # [U (source = head slice), B, c, H/U, D]
    return recv.permute(1, 2, 0, 3, 4).reshape(b, uc // u, u * hu, d)


def head_sharded(core, group: ProcessGroup | None):
    """An attention core over every row of the sequence for 1/U of the heads, as a rank's attention over its own
    rows and all heads: q, k, v exchanged in one all-to-all before `core`, its output exchanged back after."""

    def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        dh = q.shape[-1]
        q, k, v = scatter_heads(torch.cat([q, k, v], dim=-1), group).split(dh, dim=-1)
        return gather_heads(core(q, k, v), group)

    return attention
