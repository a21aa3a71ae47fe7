"""Hostile clients against the real app on a fake engine, served by uvicorn in a thread on loopback."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # hostile_servers, as tests/api's helpers are importable there
sys.path.insert(0, str(Path(__file__).parents[1] / "api"))

from hostile_servers import HostileServer, serve  # noqa: E402


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> HostileServer:
    with serve(tmp_path_factory.mktemp("data")) as running:
        yield running
