"""PostgreSQL job store (`--job-store postgresql://...`): one queue shared by any number of servers.

The claim selects its row with `FOR UPDATE SKIP LOCKED` inside the claiming UPDATE (one transaction), so
concurrent servers never take the same job and never wait on each other. One connection per store, in
autocommit mode, serialised by a lock; a broken connection (the database restarted) is replaced on the next
call, and a call that cannot reach the database raises `StoreUnavailable` (the API answers 503).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import psycopg
from psycopg.rows import dict_row

from h3serve.jobstore import migrations
from h3serve.jobstore.sql import Row, SQLJobStore
from h3serve.jobstore.sql_runner import Run
from h3serve.jobstore.store_errors import StoreClosed, StoreUnavailable

log = logging.getLogger("h3serve.store")
# pg_advisory_xact_lock key: servers starting together apply the migrations one at a time.
_MIGRATION_LOCK = 0x68337365  # "h3se"
T = TypeVar("T")


class PostgresJobStore(SQLJobStore):
    """`h3serve.jobstore.store.JobStore` on a PostgreSQL database."""

    shared = True
    lock_clause = "FOR UPDATE SKIP LOCKED"
    row_lock_clause = "FOR UPDATE"

    def __init__(self, url: str, connect_timeout_s: float = 10.0):
        self.url = url
        self.connect_timeout_s = connect_timeout_s
        self._lock = threading.Lock()
        self._closed = False
        self._db: psycopg.Connection[dict[str, Any]] | None = None
        with self._lock:
            self._migrate()

    def _connection(self) -> psycopg.Connection[dict[str, Any]]:
        if self._db is None or self._db.closed or self._db.broken:
            if self._db is not None:
                log.warning("job store: reconnecting to PostgreSQL")
                self._db.close()
            self._db = psycopg.connect(self.url, autocommit=True, row_factory=dict_row,
                                       connect_timeout=max(1, round(self.connect_timeout_s)))
        return self._db

    def _migrate(self) -> None:
        db = self._connection()
        with db.transaction():
            db.execute("SELECT pg_advisory_xact_lock(%s)", (_MIGRATION_LOCK,))
            db.execute(migrations.SCHEMA_VERSION_TABLE)
            row = db.execute("SELECT MAX(version) AS v FROM schema_version").fetchone()
            todo = migrations.pending("postgresql", (row or {}).get("v") or 0, "--job-store")
            for _, statements in todo:
                for statement in statements:
                    db.execute(statement)
            if todo:
                db.execute("DELETE FROM schema_version")
                db.execute("INSERT INTO schema_version (version) VALUES (%s)", (migrations.LATEST,))

    def close(self) -> None:
        """Close after the statement in flight, if any; every later call raises `StoreClosed` (rather than
        reconnecting: nobody would close that connection)."""
        with self._lock:
            self._closed = True
            if self._db is not None:
                self._db.close()

    def _run(self, sql: str, params: Sequence[Any] = ()) -> list[Row]:
        with self._lock:
            if self._closed:
                raise StoreClosed()
            try:
                return _execute(self._connection(), sql, params)
            except psycopg.OperationalError as e:  # connection refused, lost or timed out: not the query's fault
                raise _unavailable(e) from e

    def _atomic(self, work: Callable[[Run], T]) -> T:
        with self._lock:
            if self._closed:
                raise StoreClosed()
            try:
                db = self._connection()
                with db.transaction():
                    return work(lambda sql, params: _execute(db, sql, params))
            except psycopg.OperationalError as e:
                raise _unavailable(e) from e


def _execute(db: psycopg.Connection[dict[str, Any]], sql: str, params: Sequence[Any]) -> list[Row]:
    cursor = db.execute(sql.replace("?", "%s"), tuple(params))
    return list(cursor.fetchall()) if cursor.description else []


def _unavailable(e: psycopg.OperationalError) -> StoreUnavailable:
    first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return StoreUnavailable(f"the job database is unreachable ({first_line})")
