"""SQLite job store: every job's record, durable across restarts (WAL journal, synchronous=FULL).

One connection, serialised by a lock: the writes are small (a progress tick, a status change) and SQLite
makes each statement atomic, so a crash leaves every record either before or after a change.
"""

from __future__ import annotations

import json
import logging
import sqlite3
import threading
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

from h3serve.engine.jobs import Job, JobError
from h3serve.request import GenerationRequest, MediaRef

log = logging.getLogger("h3serve.store")
SCHEMA_VERSION = 1
_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT NOT NULL UNIQUE,
    model TEXT NOT NULL,
    request TEXT NOT NULL,
    created_at INTEGER NOT NULL,
    size TEXT NOT NULL,
    seconds TEXT NOT NULL,
    num_frames INTEGER NOT NULL,
    fps INTEGER NOT NULL,
    duration_s REAL NOT NULL,
    status TEXT NOT NULL,
    progress INTEGER NOT NULL,
    completed_at INTEGER,
    expires_at INTEGER,
    stage_durations TEXT NOT NULL,
    peak_memory_mb REAL NOT NULL,
    inference_time_s REAL,
    error TEXT,
    sync INTEGER NOT NULL,
    expired INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS jobs_status ON jobs (status);
"""
_COLUMNS = tuple(f.name for f in fields(Job) if f.name != "seq")
_PAGE_ORDERS = {"asc": ("ASC", ">"), "desc": ("DESC", "<")}


# -- request codec: GenerationRequest <-> JSON (media files as tagged objects) ------------------------------


def encode_request(request: GenerationRequest) -> str:
    def encode(value: Any) -> Any:
        if isinstance(value, MediaRef):
            return {"$media": {"path": str(value.path), "name": value.name, "kind": value.kind}}
        if isinstance(value, tuple | list):
            return [encode(v) for v in value]
        return value

    return json.dumps({f.name: encode(getattr(request, f.name)) for f in fields(request)})


def decode_request(text: str) -> GenerationRequest:
    def decode(value: Any) -> Any:
        if isinstance(value, dict) and "$media" in value:
            media = value["$media"]
            return MediaRef(path=Path(media["path"]), name=media["name"], kind=media["kind"])
        if isinstance(value, list):
            return tuple(decode(v) for v in value)
        return value

    known = {f.name for f in fields(GenerationRequest)}
    return GenerationRequest(**{k: decode(v) for k, v in json.loads(text).items() if k in known})


def _to_sql(name: str, value: Any) -> Any:
    if name == "request":
        return encode_request(value)
    if name == "stage_durations":
        return json.dumps(value)
    if name == "error":
        return None if value is None else json.dumps({"code": value.code, "message": value.message})
    if name in ("sync", "expired"):
        return int(bool(value))
    return value


def _from_row(row: sqlite3.Row) -> Job:
    values = {name: row[name] for name in _COLUMNS}
    values["request"] = decode_request(values["request"])
    values["stage_durations"] = json.loads(values["stage_durations"])
    values["error"] = None if values["error"] is None else JobError(**json.loads(values["error"]))
    values["sync"], values["expired"] = bool(values["sync"]), bool(values["expired"])
    return Job(seq=row["seq"], **values)


def _decoded(row: sqlite3.Row) -> Job | None:
    """A listed row; None (logged) for one that no longer decodes, so it cannot break a whole page."""
    try:
        return _from_row(row)
    except Exception:
        log.exception("job %s: its stored record does not decode; left out of the listing", row["id"])
        return None


class SQLiteJobStore:
    """`h3serve.engine.jobs.JobStore` on one SQLite file."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._db.row_factory = sqlite3.Row
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        version = self._db.execute("PRAGMA user_version").fetchone()[0]
        if version not in (0, SCHEMA_VERSION):
            raise RuntimeError(f"{path}: job store schema {version} is newer than this h3serve ({SCHEMA_VERSION})")
        self._db.executescript(_SCHEMA)
        self._db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _query(self, sql: str, params: tuple = ()) -> list[sqlite3.Row]:
        with self._lock:
            return self._db.execute(sql, params).fetchall()

    def insert(self, job: Job) -> Job:
        placeholders = ", ".join("?" for _ in _COLUMNS)
        values = tuple(_to_sql(name, getattr(job, name)) for name in _COLUMNS)
        with self._lock:
            cursor = self._db.execute(f"INSERT INTO jobs ({', '.join(_COLUMNS)}) VALUES ({placeholders})", values)
            return replace(job, seq=cursor.lastrowid)

    def get(self, job_id: str) -> Job | None:
        rows = self._query("SELECT * FROM jobs WHERE id = ?", (job_id,))
        return _from_row(rows[0]) if rows else None

    def update(self, job_id: str, **changes: Any) -> None:
        unknown = set(changes) - set(_COLUMNS)
        if unknown or "id" in changes:
            raise ValueError(f"cannot update job fields {sorted(unknown | ({'id'} & set(changes)))}")
        assignments = ", ".join(f"{name} = ?" for name in changes)
        values = tuple(_to_sql(name, value) for name, value in changes.items())
        with self._lock:
            self._db.execute(f"UPDATE jobs SET {assignments} WHERE id = ?", (*values, job_id))

    def delete(self, job_id: str) -> bool:
        with self._lock:
            return self._db.execute("DELETE FROM jobs WHERE id = ?", (job_id,)).rowcount > 0

    def ids(self) -> set[str]:
        return {row["id"] for row in self._query("SELECT id FROM jobs")}

    def unfinished(self) -> list[Job]:
        rows = self._query("SELECT * FROM jobs WHERE status IN ('queued', 'in_progress') ORDER BY seq")
        return [_from_row(r) for r in rows]

    def sync_jobs(self) -> list[Job]:
        return [_from_row(r) for r in self._query("SELECT * FROM jobs WHERE sync = 1 ORDER BY seq")]

    def due_to_expire(self, now: int) -> list[Job]:
        rows = self._query(
            "SELECT * FROM jobs WHERE expired = 0 AND expires_at IS NOT NULL AND expires_at <= ? ORDER BY seq", (now,)
        )
        return [_from_row(r) for r in rows]

    def count_by_status(self) -> dict[str, int]:
        rows = self._query("SELECT status, COUNT(*) AS n FROM jobs WHERE sync = 0 GROUP BY status")
        return {row["status"]: row["n"] for row in rows}

    def page(self, after: str | None, limit: int, order: str) -> tuple[list[Job], bool]:
        """Listed (non-sync) jobs in creation order, `limit` after the cursor job; `has_more` as the second item.

        An unknown cursor gives an empty page (the cursor job may have been deleted meanwhile)."""
        direction, compare = _PAGE_ORDERS[order]
        sql, params = "SELECT * FROM jobs WHERE sync = 0", []
        if after is not None:
            sql += f" AND seq {compare} (SELECT seq FROM jobs WHERE id = ?)"
            params.append(after)
        rows = self._query(f"{sql} ORDER BY seq {direction} LIMIT ?", (*params, limit + 1))
        return [job for job in map(_decoded, rows[:limit]) if job is not None], len(rows) > limit
