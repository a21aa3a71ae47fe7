"""The seam both SQL stores fill (SQLite, PostgreSQL): one statement on its own, or several in one transaction.

Queries are written once with `?` placeholders; a store runs them on its connection. `atomic` is how a job's final
state and its webhook events are written together (h3serve/jobstore/sql.py, webhook_sql.py): all or nothing."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

Row = Mapping[str, Any]
Run = Callable[[str, Sequence[Any]], list[Row]]  # (sql, params) -> the rows it returns (none: [])
T = TypeVar("T")


class SQLRunner:
    """What the queries need from a store's connection; subclasses supply `_run`, `_atomic` and the dialect."""

    shared = False  # whether other processes may use the same store (then the data dir is shared too)
    lock_clause = ""  # appended to a queue's row selection (PostgreSQL: FOR UPDATE SKIP LOCKED)
    row_lock_clause = ""  # appended to a read that a transaction then writes (PostgreSQL: FOR UPDATE)

    def _run(self, sql: str, params: Sequence[Any] = ()) -> list[Row]:
        """Execute one statement atomically, `?` placeholders; the rows it returns (none: [])."""
        raise NotImplementedError

    def _atomic(self, work: Callable[[Run], T]) -> T:
        """Call `work(run)` inside one transaction: every statement it runs takes effect, or (it raised) none."""
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError
