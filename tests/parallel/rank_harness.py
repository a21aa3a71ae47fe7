"""Run a function on N spawned gloo ranks (1 CPU thread each) and collect what every rank returns."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from h3serve.parallel.launch import RankFailure, run_on_ranks


def run_ranks(world: int, target: Callable, *args: Any, timeout_s: float = 300.0) -> list[Any]:
    """`target(rank, world, *args)` on `world` ranks; returns the values by rank, or fails with a rank's traceback."""
    try:
        return run_on_ranks(world, target, *args, threads=1, timeout_s=timeout_s)
    except RankFailure as e:
        raise AssertionError(str(e)) from None
