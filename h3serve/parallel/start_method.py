"""How rank processes start: `spawn` (the default: a fresh interpreter per rank) or `forkserver`.

With `H3SERVE_RANK_START=forkserver` every rank is forked from one server process that has already imported the
rank side (torch, diffusers' VAEs, the model): a rank starts in a fraction of a second instead of spending ~6 s of
CPU on imports. The server imports modules only; it initialises no CUDA context and starts no thread pool, so a
forked rank is as clean as a spawned one. The suite runs its ranks this way (tests/conftest.py).

Either way a rank sees the environment of the moment it was started (a forked rank would otherwise see the
server's, frozen when it started), and `multiprocessing.parent_process()` is the process that started it.
Torch-free: the parent side (engine/executor.py) starts its ranks through it.
"""

from __future__ import annotations

import multiprocessing as mp
import os
from collections.abc import Callable
from multiprocessing.context import BaseContext
from typing import Any

from h3serve.errors import ConfigError

START_ENV = "H3SERVE_RANK_START"
START_METHODS = ("spawn", "forkserver")
# What the fork server imports once: the rank worker and engine, the pipeline with diffusers' VAE classes.
PRELOAD = ["h3serve.rank.worker", "h3serve.rank.model_runner", "h3serve.parallel.launch"]


def rank_context() -> BaseContext:
    """The multiprocessing context rank processes are started from (`H3SERVE_RANK_START`, default spawn)."""
    method = os.environ.get(START_ENV, "spawn")
    if method not in START_METHODS:
        raise ConfigError(f"environment variable {START_ENV}={method!r} must be one of {', '.join(START_METHODS)}")
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(PRELOAD)
    return ctx


def start_rank(
    ctx: BaseContext,
    target: Callable[..., Any],
    args: tuple,
    kwargs: dict[str, Any] | None = None,
    name: str | None = None,
    daemon: bool = True,
) -> mp.process.BaseProcess:
    """Start `target(*args, **kwargs)` in a rank process that runs with this process' current environment."""
    process = ctx.Process(
        target=_with_environment, args=(dict(os.environ), target, args, kwargs or {}), name=name, daemon=daemon
    )
    process.start()
    return process


def _with_environment(environment: dict[str, str], target: Callable[..., Any], args: tuple, kwargs: dict) -> None:
    if os.environ != environment:
        os.environ.clear()
        os.environ.update(environment)
    target(*args, **kwargs)
