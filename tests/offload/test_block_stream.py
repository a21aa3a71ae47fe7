"""Streaming blocks: which stream each load is issued on, the two reused slots, pinned host arenas (issue 24)."""

from __future__ import annotations

import gc

import pytest
import torch
from torch import nn

from h3serve.offload.runtime import _BlockStream, share_slots
from h3serve.offload.units import GatheredUnit, HostUnit

CPU = torch.device("cpu")
COPY_STREAM = object()  # stands in for the CUDA side stream


class _Unit:
    def __init__(self, collective: bool, log: list):
        self.collective, self.log = collective, log

    def load(self, stream=None):
        self.log.append(stream)

    def load_ahead(self):
        self.log.append("ahead")

    def wait(self):
        pass

    def release(self):
        pass


def test_collective_prefetches_stay_on_the_compute_stream():
    """A gathered block's all-gather would run on the side stream concurrently with the compute stream's
    all-to-all / all-reduce on other communicators (NCCL: may deadlock); it is issued from the compute stream
    (`load_ahead`), rank-local copies go to the side stream."""
    assert GatheredUnit.collective and not HostUnit.collective
    for collective, prefetch in ((False, COPY_STREAM), (True, "ahead")):
        log: list = []
        blocks = nn.Sequential(*(nn.Identity() for _ in range(3)))
        _BlockStream(list(blocks), [_Unit(collective, log) for _ in blocks], COPY_STREAM, cycle_to=0)
        blocks(nn.Parameter())
        # Each block: its own (no-op) load on the compute stream, then the next block's prefetch.
        assert log == [None, prefetch] * 3


def test_a_prefetched_gather_stays_in_flight_until_its_block_runs():
    """Where the blocks' collectives share the gather's communicator (`overlap`), a prefetch issues its all-gathers
    and leaves them in flight; the block's `wait` completes them (issue 29, item 4). Without `overlap` a prefetch
    completes at once, as before. One gloo rank stands in for the group; the block is rebuilt bit for bit."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        for overlap in (False, True):
            block = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16))
            block[1].to(torch.float64)
            want = {k: v.clone() for k, v in block.state_dict().items()}
            unit = GatheredUnit(block, "transformer", "stream", CPU, lambda *_: None, dist.group.WORLD,
                                overlap=overlap)
            unit.load_ahead()
            assert unit.loaded and len(unit._works) == (2 if overlap else 0)  # one gather per dtype
            unit.wait()
            assert not unit._works
            assert all(torch.equal(block.state_dict()[k], v) for k, v in want.items())
            unit.release()
            assert not unit.loaded
    finally:
        dist.destroy_process_group()


def _stack(n: int = 5) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Linear(16, 24) if i % 2 == 0 else nn.Linear(24, 16) for i in range(n)))


def test_streamed_blocks_reuse_two_slot_buffers():
    """However many blocks stream, and over several passes (denoise steps), two slot buffers exist; each block's
    tensors are views of one of them while it runs (issue 24, defect 2). On CUDA the runtime gives every streamed
    unit the pair; here the pair is on the CPU, which runs the same bookkeeping with plain copies."""
    blocks, x = _stack(), torch.randn(3, 16)
    expected = blocks(x)
    units = [HostUnit(b, "transformer", "stream", CPU, lambda *_: None) for b in blocks]
    pair = share_slots(units, CPU)
    _BlockStream(list(blocks), units, None, cycle_to=0)
    live, inside = [], []

    def check(module, _args):
        live.append(pair.live)
        spans = [(b.data_ptr(), b.data_ptr() + b.numel()) for b in pair.buffers if b is not None]
        inside.append(all(any(a <= p.data_ptr() < z for a, z in spans) for p in module.parameters()))

    for block in blocks:
        block.register_forward_pre_hook(check)
    for _ in range(3):
        assert torch.equal(blocks(x), expected)
    assert max(live) == 2 and all(inside) and pair.allocations == 2
    for unit in units:
        unit.release()
    pair.drop()
    assert pair.live == 0
    units[0].load()
    units[1].load()
    with pytest.raises(RuntimeError, match="a third block was loaded before one was released"):
        units[2].load()


def test_pinned_host_memory_is_exactly_the_plan(monkeypatch):
    """Each unit pins one arena of exactly its bytes (no power-of-two rounding of the caching host allocator):
    the DiT's pinned bytes equal the planner's host figure (issue 24, defect 3). cudaHostRegister is stood in."""
    from small_dit import SMALL_DIT

    from h3serve.model.transformer import H3Transformer, H3TransformerConfig
    from h3serve.offload import host_arena
    from h3serve.offload.inventory import dit_bytes
    from h3serve.offload.runtime import streamed_blocks

    registered = []
    monkeypatch.setattr(host_arena, "_register", lambda ptr, size: registered.append(size))
    monkeypatch.setattr(host_arena, "_unregister", lambda ptr: None)
    cfg = H3TransformerConfig(**SMALL_DIT)
    model = H3Transformer(cfg)
    before = host_arena.pinned_bytes()
    units = [
        HostUnit(block, "transformer", "stream", CPU, lambda *_: None, pin=True)
        for group in streamed_blocks("transformer", model).values()
        for block in group
    ]
    planned = dit_bytes("transformer", cfg, torch.float32)
    assert host_arena.pinned_bytes() - before == sum(registered) == sum(u.host_bytes for u in units)
    assert sum(registered) == sum(b for g in planned.groups for b in g.block_bytes)
    assert len(registered) == len(units)  # one registration (one arena) per unit
    del units
    gc.collect()
    assert host_arena.pinned_bytes() == before


def test_an_arena_holds_mixed_dtypes_as_views_without_padding():
    from h3serve.offload.host_arena import HostArena

    tensors = [torch.arange(3, dtype=torch.bfloat16), torch.randn(5), torch.ones(7, dtype=torch.uint8),
               torch.randn(2, 3, dtype=torch.float64)]
    arena = HostArena(tensors, pin=False)
    assert arena.nbytes == 3 * 2 + 5 * 4 + 7 + 6 * 8 and not arena.pinned
    for view, t in zip(arena.views, tensors, strict=True):
        assert torch.equal(view, t) and view.dtype == t.dtype
        assert view.untyped_storage().data_ptr() == arena.buffer.untyped_storage().data_ptr()
