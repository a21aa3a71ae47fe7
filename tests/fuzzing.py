"""Fuzz tests replay a fixed, recorded example set in the suite, so a red run reproduces; `make fuzz` runs the same
tests (marked `fuzz`) with a fresh seed and more examples, printing the seed so that what it finds can be replayed
(`FUZZ_SEED=N make fuzz`) and then fixed with a recorded test."""

from __future__ import annotations

import functools
import importlib
import os
import pkgutil
import random
from collections.abc import Iterator
from contextlib import contextmanager

from hypothesis.internal.conjecture import providers
from hypothesis.internal.constants_ast import Constants, constants_from_module
from hypothesis.internal.floats import float_to_int
from sortedcontainers import SortedSet

RANDOMISED = os.environ.get("H3SERVE_FUZZ") == "1"  # set by `make fuzz`


def fuzz_seed(recorded: int) -> int:
    """`recorded` in the suite; under `make fuzz`, $FUZZ_SEED or a fresh seed, printed."""
    if not RANDOMISED:
        return recorded
    seed = int(os.environ.get("FUZZ_SEED") or random.SystemRandom().randrange(2**32))
    print(f"FUZZ_SEED={seed}")
    return seed


def fuzz_examples(recorded: int) -> int:
    """`recorded` in the suite; under `make fuzz`, $FUZZ_EXAMPLES (default ten times as many)."""
    return int(os.environ.get("FUZZ_EXAMPLES") or recorded * 10) if RANDOMISED else recorded


@functools.cache
def _constants_of(packages: tuple[str, ...]) -> Constants:
    """The constants of every module of `packages`, each imported, in sorted sets (a plain set's order follows the
    interpreter's string hashing); built once per process."""
    pool = Constants(integers=SortedSet(), floats=SortedSet(key=float_to_int), bytes=SortedSet(), strings=SortedSet())
    for name in packages:
        package = importlib.import_module(name)
        modules = [package] + [importlib.import_module(info.name)
                               for info in pkgutil.walk_packages(package.__path__, f"{name}.")]
        for module in modules:
            for constant in constants_from_module(module):
                pool.add(constant)
    return pool


@contextmanager
def fixed_constants(*packages: str) -> Iterator[None]:
    """Hypothesis draws now and then (5 %) a constant it harvested from the source of every local module in
    `sys.modules`, so what one seed draws depends on which modules the worker's earlier tests happened to import
    (the schema fuzz drew other requests after `tests/hostile/test_media_bombs.py` had imported the rank side). Inside
    this block the pool is the constants of `packages`' modules only: one seed, one example set, whatever ran
    before."""
    pool = _constants_of(packages)
    harvest = providers._get_local_constants  # private (hypothesis 6.170): tests/test_fuzzing.py checks it
    providers._get_local_constants = lambda: pool
    providers.CONSTANTS_CACHE.cache.clear()
    try:
        yield
    finally:
        providers._get_local_constants = harvest
        providers.CONSTANTS_CACHE.cache.clear()
