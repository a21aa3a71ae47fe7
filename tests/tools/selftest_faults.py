"""Broken rank paths for the selftest's multi-GPU checks, importable by the spawned ranks (the parent's monkeypatch
does not reach a spawned process: the test points the session at one of these instead)."""

from __future__ import annotations

import torch.distributed as dist

from h3serve.tools.selftest import parallel_checks


def all_reduce_one_percent_high(rank: int, world: int, spec) -> dict:
    """The session with an all-reduce that returns its sum 1% too high (on this rank's process only)."""
    exact = dist.all_reduce

    def wrong(tensor, *args, **kwargs):
        work = exact(tensor, *args, **kwargs)
        tensor.mul_(1.01)
        return work

    dist.all_reduce = wrong
    return parallel_checks.rank_session(rank, world, spec)
