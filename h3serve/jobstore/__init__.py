"""Job persistence, one home: the job record and statuses, the store protocol, its SQLite and PostgreSQL
implementations with their schema migrations, and the job files on disk. Imports nothing from engine/ or api/."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from h3serve.extras import installed, require
from h3serve.jobstore.sqlite import SQLiteJobStore
from h3serve.jobstore.store import JobStore

POSTGRES_SCHEMES = ("postgresql://", "postgres://")


def is_postgres_url(target: str) -> bool:
    return target.startswith(POSTGRES_SCHEMES)


def open_job_store(target: str | Path) -> JobStore:
    """A PostgreSQL store for a `postgresql://` URL (the `postgres` extra), else a SQLite store on the file
    `target`."""
    if isinstance(target, str) and is_postgres_url(target):
        require("postgres", "--job-store postgresql://")
        from h3serve.jobstore.postgres import PostgresJobStore  # optional: imported only when asked for

        return PostgresJobStore(target)
    return SQLiteJobStore(Path(target))


def database_errors() -> tuple[type[Exception], ...]:
    """What opening a store raises when its database cannot be reached or read."""
    if not installed("postgres"):
        return (sqlite3.Error,)
    import psycopg

    return (sqlite3.Error, psycopg.Error)
