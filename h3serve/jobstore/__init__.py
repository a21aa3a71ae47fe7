"""Job persistence, one home: the job record and statuses, the store protocol, its SQLite and PostgreSQL
implementations with their schema migrations, and the job files on disk. Imports nothing from engine/ or api/."""

from __future__ import annotations

from pathlib import Path

from h3serve.jobstore.postgres import PostgresJobStore, is_postgres_url
from h3serve.jobstore.sqlite import SQLiteJobStore
from h3serve.jobstore.store import JobStore


def open_job_store(target: str | Path) -> JobStore:
    """A PostgreSQL store for a `postgresql://` URL, else a SQLite store on the file `target`."""
    if isinstance(target, str) and is_postgres_url(target):
        return PostgresJobStore(target)
    return SQLiteJobStore(Path(target))
