"""Shared fixtures, built once per test session: the tiny checkpoint and its loaded components."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import pytest

# Tests never touch the user's cache: the default checkpoint location points into a temp dir.
os.environ.setdefault("H3SERVE_CACHE_DIR", str(Path(os.environ.get("TMPDIR", "/tmp")) / f"h3serve-test-{os.getpid()}"))
# Rank processes fork from one server that has imported the rank side once (h3serve/parallel/start_method.py),
# instead of each spending seconds of CPU on imports; tests/parallel/test_start_method.py runs the spawn default.
os.environ.setdefault("H3SERVE_RANK_START", "forkserver")
# Under pytest-xdist each worker gets its share of the cores for torch's intra-op threads (read when torch is first
# imported, after this file): two workers of two threads each on two cores spend their time preempting each other.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    _share = max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    os.environ.setdefault("OMP_NUM_THREADS", str(_share))


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> Path:
    from h3serve.tools.tiny.make_checkpoint import build_tiny_checkpoint

    return build_tiny_checkpoint(tmp_path_factory.mktemp("checkpoint") / "tiny", seed=0)


@pytest.fixture(scope="session")
def tiny_native_checkpoint(tiny_checkpoint, tmp_path_factory) -> Path:
    """The same weights as `tiny_checkpoint`, in the native MiniMaxAI layout (FL2VA/ + Ref2VA/)."""
    from h3serve.tools.tiny.make_native import native_from_modular

    return native_from_modular(tiny_checkpoint, tmp_path_factory.mktemp("checkpoint") / "tiny-native")


@pytest.fixture(scope="session")
def tiny_pipeline(tiny_checkpoint):
    from h3serve.checkpoint.resolver import read_layout
    from h3serve.loading.components import load_components
    from h3serve.model.pipeline import H3Pipeline

    layout = read_layout(tiny_checkpoint)
    return H3Pipeline(load_components(layout)), layout.defaults()


@pytest.fixture(scope="session")
def postgres_server():
    """A real PostgreSQL server for the whole session (see tests/postgres_server.py); never skipped."""
    from postgres_server import start_postgres

    server = start_postgres()
    yield server
    server.stop()


@pytest.fixture
def postgres_url(postgres_server) -> str:
    """A fresh, empty database on the session's PostgreSQL server."""
    return postgres_server.new_database()


@pytest.fixture(scope="session")
def ceph_gateway(tmp_path_factory):
    """The single-node Ceph S3 gateway (tests/ceph_gateway.py), one for the whole run: every pytest-xdist worker
    shares it. The tests that need it skip, with the reason, only where it cannot start (not root, Ceph missing)."""
    from ceph_gateway import GatewayUnavailable, shared_gateway

    base = tmp_path_factory.getbasetemp()
    folder = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base  # the workers' common folder
    with contextlib.ExitStack() as stack:
        try:
            gateway = stack.enter_context(shared_gateway(folder))
        except GatewayUnavailable as e:
            pytest.skip(f"the Ceph S3 gateway cannot start here: {e}")
        yield gateway


@pytest.fixture
def bucket(ceph_gateway) -> str:
    """A fresh, empty bucket on the session's gateway."""
    return ceph_gateway.new_bucket()


@pytest.fixture
def aws_env(ceph_gateway, monkeypatch) -> dict[str, str]:
    """The gateway's test credentials in this process's environment (the AWS chain boto3 reads)."""
    for name, value in ceph_gateway.credentials_env.items():
        monkeypatch.setenv(name, value)
    return ceph_gateway.credentials_env
