"""The module-scoped real-time server on a fake engine (realtime_servers.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from realtime_servers import RealtimeServer, serve_realtime


@pytest.fixture(scope="module")
def realtime_server(tmp_path_factory) -> Iterator[RealtimeServer]:
    with serve_realtime(tmp_path_factory.mktemp("realtime")) as server:
        yield server
