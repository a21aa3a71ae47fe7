"""Fuzz tests replay a fixed, recorded example set in the suite, so a red run reproduces; `make fuzz` runs the same
tests (marked `fuzz`) with a fresh seed and more examples, printing the seed so that what it finds can be replayed
(`FUZZ_SEED=N make fuzz`) and then fixed with a recorded test."""

from __future__ import annotations

import os
import random

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
