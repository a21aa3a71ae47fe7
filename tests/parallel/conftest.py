"""Session fixture: the tiny checkpoint with 4 DiT heads and a 2-KV-head text encoder (see tiny_parallel)."""

from __future__ import annotations

from pathlib import Path

import pytest
from tiny_parallel import build_parallel_checkpoint


@pytest.fixture(scope="session")
def parallel_checkpoint(tiny_checkpoint, tmp_path_factory) -> Path:
    return build_parallel_checkpoint(tiny_checkpoint, tmp_path_factory.mktemp("parallel") / "tiny-parallel")
