"""Collective helpers shared by the strategies. A `None` group means "this degree is 1": every helper is a no-op.

All of them work on gloo (CPU) and NCCL (CUDA); tensors are made contiguous first because both backends
require it. Each is a `torch.compiler.disable` island: a compiled DiT block graph-breaks at the collective
instead of tracing process-group calls (h3serve.accel.compile).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from h3serve.accel.compile import count_collective

# torch 2.13 renamed all_gather_into_tensor (now deprecated); older releases only have the old name.
_all_gather_single = dist.all_gather_single if hasattr(dist, "all_gather_single") else dist.all_gather_into_tensor


def group_size(group: ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: ProcessGroup | None) -> int:
    return 0 if group is None else dist.get_rank(group)


@torch.compiler.disable
def all_reduce_(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """In-place sum over the group."""
    if group is not None:
        count_collective()
        dist.all_reduce(x, group=group)
    return x


HALF = (torch.bfloat16, torch.float16)


@torch.compiler.disable
def all_reduce_wide(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Sum over the group; half-precision partials are summed in fp32 and rounded once.

    NCCL sums bf16 in bf16, rounding after every addition, so a tensor-parallel output would drift from the
    one-rank output as the degree grows (the model card's encoder TP reduces in fp32 for the same reason). Other
    dtypes are summed in place, as `all_reduce_`."""
    if group is None:
        return x
    count_collective()
    if x.dtype not in HALF:
        dist.all_reduce(x, group=group)
        return x
    wide = x.float()
    dist.all_reduce(wide, group=group)
    return wide.to(x.dtype)


@torch.compiler.disable
def gather_into(out: torch.Tensor, x: torch.Tensor, group: ProcessGroup, async_op: bool = False):
    """Every member's `x` into one flat `out` ([n·numel], group-rank order): one collective, no temporary. With
    `async_op`, its work handle: `out` holds the result after `wait()` (on NCCL the waiting stream's later kernels
    wait for it, the host does not)."""
    count_collective()
    return _all_gather_single(out, x, group=group, async_op=async_op)


@torch.compiler.disable
def all_gather_dim(x: torch.Tensor, dim: int, group: ProcessGroup | None) -> torch.Tensor:
    """Concatenate every member's `x` along `dim`, in group-rank order."""
    n = group_size(group)
    if n == 1:
        return x
    dim = dim % x.dim()
    count_collective()
    out = torch.empty((n, *x.shape), dtype=x.dtype, device=x.device)
    _all_gather_single(out.flatten(0, 1), x.contiguous(), group=group)  # the backends want [n·d0, ...]
    return out.movedim(0, dim).flatten(dim, dim + 1)


@torch.compiler.disable
def all_to_all(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Exchange equal chunks along dim 0: chunk i goes to member i; the result's chunk j came from member j."""
    if group_size(group) == 1:
        return x
    count_collective()
    x = x.contiguous()
    out = torch.empty_like(x)  # from the contiguous x: empty_like would keep a permuted input's strides
    dist.all_to_all_single(out, x, group=group)
    return out
