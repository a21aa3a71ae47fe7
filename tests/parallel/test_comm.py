"""Collective helpers' arithmetic, with torch.distributed stood in (one process): what reaches the collective."""

from __future__ import annotations

import pytest
import torch

from h3serve.parallel import comm

GROUP = object()  # a process group as the helpers see it: anything but None


@pytest.fixture
def reduced(monkeypatch):
    """dist.all_reduce as two identical ranks would do it (x + x), recording the dtype it was handed."""
    seen: list[torch.dtype] = []

    def all_reduce(x, group=None):
        assert group is GROUP
        seen.append(x.dtype)
        x.add_(x)

    monkeypatch.setattr(comm.dist, "all_reduce", all_reduce)
    return seen


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_partials_are_summed_in_fp32_and_rounded_once(reduced, dtype):
    x = torch.randn(64, generator=torch.Generator().manual_seed(0)).to(dtype)
    out = comm.all_reduce_wide(x, GROUP)
    assert reduced == [torch.float32] and out.dtype == dtype
    assert torch.equal(out, (x.float() * 2).to(dtype))


def test_full_precision_is_summed_in_place(reduced):
    x = torch.ones(4)
    assert comm.all_reduce_wide(x, GROUP) is x and reduced == [torch.float32] and torch.equal(x, torch.full((4,), 2.0))
    assert comm.all_reduce_wide(x, None) is x and len(reduced) == 1  # degree 1: no collective


def test_row_parallel_linears_reduce_wide(reduced):
    from h3serve.parallel.tensor_parallel import RowParallelLinear

    layer = RowParallelLinear(8, 4, bias=True, group=GROUP).to(torch.bfloat16)
    layer(torch.randn(2, 8, dtype=torch.bfloat16))
    assert reduced == [torch.float32]


def test_a_gathered_block_arrives_in_one_tensor(monkeypatch):
    """all_gather_into_tensor into the block's one buffer: a list of chunks makes NCCL gather into a temporary
    flat buffer and copy out of it (twice the block's memory, not in the plan)."""
    calls = []
    monkeypatch.setattr(comm, "_all_gather_single", lambda out, x, group, async_op: calls.append((out, x, group)))
    out, x = torch.empty(8), torch.arange(4.0)
    comm.gather_into(out, x, GROUP)
    assert len(calls) == 1 and calls[0][0] is out and calls[0][1] is x and calls[0][2] is GROUP
