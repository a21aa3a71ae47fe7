"""The module-scoped API server on a fake engine (see api_servers.py for the helpers)."""

from __future__ import annotations

import pytest
from api_servers import FakeServer, serve_fake


@pytest.fixture(scope="module")
def fake_server(tmp_path_factory) -> FakeServer:
    """The real app, store and job manager on a fake engine (no model), served by uvicorn in a thread."""
    with serve_fake(tmp_path_factory.mktemp("data")) as server:
        yield server
