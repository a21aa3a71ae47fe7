"""The job store tests' stores: each test runs on SQLite and on the session's real PostgreSQL."""

from __future__ import annotations

from pathlib import Path

import pytest

from h3serve.jobstore import open_job_store


@pytest.fixture(params=["sqlite", "postgresql"])
def target(request, tmp_path) -> str | Path:
    """Where a store lives: a SQLite file, or a fresh database on the session's PostgreSQL server."""
    return tmp_path / "jobs.sqlite3" if request.param == "sqlite" else request.getfixturevalue("postgres_url")


@pytest.fixture
def store(target):
    s = open_job_store(target)
    yield s
    s.close()
