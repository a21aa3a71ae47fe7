"""SQLite job store: every job's record in one file, durable across restarts (WAL journal, synchronous=FULL).

One connection, serialised by a lock: the writes are small (a progress tick, a status change) and SQLite
makes each statement atomic, so a crash leaves every record either before or after a change. Only one
server uses a SQLite store (the data dir's lock says so): `shared` is False.
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from h3serve.jobstore import migrations
from h3serve.jobstore.sql import Row, SQLJobStore
from h3serve.jobstore.sql_runner import Run
from h3serve.jobstore.store_errors import StoreClosed

T = TypeVar("T")


class SQLiteJobStore(SQLJobStore):
    """`h3serve.jobstore.store.JobStore` on one SQLite file."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._closed = False
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._db.row_factory = sqlite3.Row
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        try:
            self._migrate(str(path))
        except BaseException:
            self._db.close()
            raise

    def _migrate(self, where: str) -> None:
        """Apply pending migrations in one transaction. h3serve 0.1 recorded its schema (version 1) only as
        PRAGMA user_version; it is kept equal to the version so older readers still see it."""
        db = self._db
        db.execute("BEGIN IMMEDIATE")
        try:
            db.execute(migrations.SCHEMA_VERSION_TABLE)
            recorded = db.execute("SELECT MAX(version) FROM schema_version").fetchone()[0]
            current = max(recorded or 0, db.execute("PRAGMA user_version").fetchone()[0])
            todo = migrations.pending("sqlite", current, where)
            for _, statements in todo:
                for statement in statements:
                    db.execute(statement)
            if todo or recorded != current:
                db.execute("DELETE FROM schema_version")
                db.execute("INSERT INTO schema_version (version) VALUES (?)", (migrations.LATEST,))
                db.execute(f"PRAGMA user_version={migrations.LATEST}")
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise

    def close(self) -> None:
        """Close after the statement in flight, if any; every later call raises `StoreClosed`."""
        with self._lock:
            self._closed = True
            self._db.close()

    def _run(self, sql: str, params: Sequence[Any] = ()) -> list[Row]:
        with self._lock:
            if self._closed:
                raise StoreClosed()
            return self._db.execute(sql, tuple(params)).fetchall()

    def _atomic(self, work: Callable[[Run], T]) -> T:
        with self._lock:
            if self._closed:
                raise StoreClosed()
            db = self._db

            def run(sql: str, params: Sequence[Any]) -> list[Row]:
                return db.execute(sql, tuple(params)).fetchall()

            db.execute("BEGIN IMMEDIATE")
            try:
                result = work(run)
            except BaseException:
                db.execute("ROLLBACK")
                raise
            db.execute("COMMIT")
            return result
