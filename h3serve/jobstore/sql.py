"""The job store's queries, shared by the SQLite and PostgreSQL stores (they differ in connection and locking).

Queue semantics (see docs/scaling.md): a runner *claims* the oldest claimable job in one atomic statement,
which marks it in progress under the runner's `owner` name and a lease; the owner renews its leases on a
heartbeat; a job whose lease ran out (its server died) is claimable again by anyone. Every change a runner
makes is conditioned on still owning the job, so a server that lost its job can never overwrite another's
result, and `finish` counts completions (exactly one per finished job)."""

from __future__ import annotations

import time
from collections.abc import Collection, Mapping
from dataclasses import replace
from typing import Any

from h3serve.jobstore.codec import COLUMNS, decoded, from_row, to_sql
from h3serve.jobstore.records import FINISHED, UNFINISHED, Job
from h3serve.jobstore.sql_runner import Row, Run
from h3serve.jobstore.webhook_sql import WebhookSQL, queue_job_event

_PAGE_ORDERS = {"asc": ("ASC", ">"), "desc": ("DESC", "<")}
_UNFINISHED_SQL = "(" + ", ".join(f"'{s}'" for s in UNFINISHED) + ")"
# What a statement that may end a job returns: enough to write its webhook event in the same transaction.
_EVENT_FIELDS = "id, status, sync, key_scope, completed_at"

__all__ = ["Row", "SQLJobStore"]


class SQLJobStore(WebhookSQL):
    """`h3serve.jobstore.store.JobStore` over a DB-API connection; subclasses supply `_run`, `_atomic` and the
    dialect (h3serve/jobstore/sql_runner.py). Every statement that gives a job its final state writes the job's
    webhook event in the same transaction (webhook_sql.py)."""

    # -- records -------------------------------------------------------------------------------------------

    def insert(self, job: Job) -> Job:
        placeholders = ", ".join("?" for _ in COLUMNS)
        values = tuple(to_sql(name, getattr(job, name)) for name in COLUMNS)
        rows = self._run(f"INSERT INTO jobs ({', '.join(COLUMNS)}) VALUES ({placeholders}) RETURNING seq", values)
        return replace(job, seq=rows[0]["seq"])

    def get(self, job_id: str) -> Job | None:
        rows = self._run("SELECT * FROM jobs WHERE id = ?", (job_id,))
        return from_row(rows[0]) if rows else None

    @staticmethod
    def _assignments(changes: Mapping[str, Any]) -> tuple[str, tuple[Any, ...]]:
        unknown = set(changes) - set(COLUMNS)
        if unknown or "id" in changes:
            raise ValueError(f"cannot update job fields {sorted(unknown | ({'id'} & set(changes)))}")
        return ", ".join(f"{name} = ?" for name in changes), tuple(to_sql(n, v) for n, v in changes.items())

    def update(self, job_id: str, **changes: Any) -> None:
        """Change fields; a change that finishes an unfinished job writes its webhook event with it."""
        assignments, values = self._assignments(changes)
        sql = f"UPDATE jobs SET {assignments} WHERE id = ? RETURNING {_EVENT_FIELDS}"
        if changes.get("status") not in FINISHED:
            self._run(sql, (*values, job_id))
            return

        def finish(run: Run) -> None:
            before = run(f"SELECT status FROM jobs WHERE id = ? {self.row_lock_clause}", (job_id,))
            rows = run(sql, (*values, job_id))
            if rows and before and before[0]["status"] in UNFINISHED:
                queue_job_event(run, rows[0], time.time())

        self._atomic(finish)

    def delete(self, job_id: str) -> bool:
        """Remove the record; an unfinished job's deletion (a cancel) writes its video.failed event with it."""

        def delete(run: Run) -> bool:
            rows = run(f"DELETE FROM jobs WHERE id = ? RETURNING {_EVENT_FIELDS}", (job_id,))
            if rows and rows[0]["status"] in UNFINISHED:
                queue_job_event(run, rows[0], time.time())
            return bool(rows)

        return self._atomic(delete)

    def ids(self) -> set[str]:
        return {row["id"] for row in self._run("SELECT id FROM jobs")}

    def unfinished(self) -> list[Job]:
        return [from_row(r) for r in self._run(f"SELECT * FROM jobs WHERE status IN {_UNFINISHED_SQL} ORDER BY seq")]

    def sync_jobs(self) -> list[Job]:
        return [from_row(r) for r in self._run("SELECT * FROM jobs WHERE sync = 1 ORDER BY seq")]

    def due_to_expire(self, now: int) -> list[Job]:
        rows = self._run(
            "SELECT * FROM jobs WHERE expired = 0 AND expires_at IS NOT NULL AND expires_at <= ? ORDER BY seq", (now,)
        )
        return [from_row(r) for r in rows]

    def count_by_status(self) -> dict[str, int]:
        rows = self._run("SELECT status, COUNT(*) AS n FROM jobs WHERE sync = 0 GROUP BY status")
        return {row["status"]: int(row["n"]) for row in rows}

    def count_queued(self) -> int:
        """Outputs waiting for a runner, sync jobs included (what `--max-queue` bounds): a job of N outputs counts N."""
        return int(self._run("SELECT COALESCE(SUM(num_outputs), 0) AS n FROM jobs WHERE status = 'queued'")[0]["n"])

    def page(self, after: str | None, limit: int, order: str) -> tuple[list[Job], bool]:
        """Listed (non-sync) jobs in creation order, `limit` after the cursor job; `has_more` as the second item.

        An unknown cursor gives an empty page (the cursor job may have been deleted meanwhile)."""
        direction, compare = _PAGE_ORDERS[order]
        sql, params = "SELECT * FROM jobs WHERE sync = 0", []
        if after is not None:
            sql += f" AND seq {compare} (SELECT seq FROM jobs WHERE id = ?)"
            params.append(after)
        rows = self._run(f"{sql} ORDER BY seq {direction} LIMIT ?", (*params, limit + 1))
        return [job for job in map(decoded, rows[:limit]) if job is not None], len(rows) > limit

    # -- the shared queue ------------------------------------------------------------------------------------

    def claim(self, owner: str, lease_s: float) -> Job | None:
        """Take the oldest claimable job for `owner` (in progress, leased until now + `lease_s`), or None.

        Claimable: queued (a sync job only by its own server, whose HTTP client waits for it), or in progress
        under a lease that ran out (its server died; the job reruns from the start)."""
        now = time.time()
        rows = self._run(
            "UPDATE jobs SET status = 'in_progress', progress = 0, owner = ?, lease_expires_at = ? "
            "WHERE seq = (SELECT seq FROM jobs WHERE (status = 'queued' AND (sync = 0 OR owner = ?)) "
            "OR (status = 'in_progress' AND sync = 0 AND (lease_expires_at IS NULL OR lease_expires_at < ?)) "
            f"ORDER BY seq LIMIT 1 {self.lock_clause}) RETURNING *",
            (owner, now + lease_s, owner, now),
        )
        return from_row(rows[0]) if rows else None

    def renew(self, owner: str, lease_s: float, job_ids: Collection[str]) -> set[str]:
        """Extend `owner`'s leases on `job_ids` (the jobs it runs or waits for); the ids it still holds (one
        missing was deleted, or reclaimed by another server after this one's lease ran out). A job `owner`
        holds but no longer names (its outcome could not be recorded) is left to run out and be claimed again."""
        ids = sorted(job_ids)
        if not ids:
            return set()
        rows = self._run(
            f"UPDATE jobs SET lease_expires_at = ? WHERE owner = ? AND status IN {_UNFINISHED_SQL} "
            f"AND id IN ({', '.join('?' for _ in ids)}) RETURNING id",
            (time.time() + lease_s, owner, *ids),
        )
        return {row["id"] for row in rows}

    def update_owned(self, job_id: str, owner: str, **changes: Any) -> bool:
        """`update` only while `owner` holds the running job; False (nothing changed) otherwise."""
        assignments, values = self._assignments(changes)
        sql = f"UPDATE jobs SET {assignments} WHERE id = ? AND owner = ? AND status = 'in_progress' RETURNING id"
        return bool(self._run(sql, (*values, job_id, owner)))

    def finish(self, job_id: str, owner: str, **changes: Any) -> bool:
        """Record the outcome of `owner`'s run (completed or failed), once, with its webhook event: True if
        recorded, False if the job was deleted or another server holds it now. Counts the completion in
        `completions`."""
        assignments, values = self._assignments(changes)
        sql = (f"UPDATE jobs SET {assignments}, completions = completions + 1, lease_expires_at = NULL "
               f"WHERE id = ? AND owner = ? AND status = 'in_progress' RETURNING {_EVENT_FIELDS}")

        def finish(run: Run) -> bool:
            rows = run(sql, (*values, job_id, owner))
            if rows:  # the outbox write: the event exists exactly when the outcome does
                queue_job_event(run, rows[0], time.time())
            return bool(rows)

        return self._atomic(finish)

    def release(self, job_id: str, owner: str) -> bool:
        """Put `owner`'s running job back in the queue (a shutdown stopped it); False if it no longer holds it."""
        sql = ("UPDATE jobs SET status = 'queued', progress = 0, owner = NULL, lease_expires_at = NULL "
               "WHERE id = ? AND owner = ? AND status = 'in_progress' RETURNING id")
        return bool(self._run(sql, (job_id, owner)))

    def release_all(self) -> None:
        """Every unfinished job back in the queue, unowned: for a store only this process uses, at start-up."""
        self._run("UPDATE jobs SET status = 'queued', progress = 0, owner = NULL, lease_expires_at = NULL "
                  f"WHERE status IN {_UNFINISHED_SQL}")

    def reap_orphaned_sync(self) -> list[str]:
        """Delete unfinished sync jobs whose server is gone (lease run out or released); their ids. Nobody
        could collect them: their HTTP clients were connected to that server."""
        rows = self._run(
            f"DELETE FROM jobs WHERE sync = 1 AND status IN {_UNFINISHED_SQL} "
            "AND (owner IS NULL OR lease_expires_at IS NULL OR lease_expires_at < ?) RETURNING id",
            (time.time(),),
        )
        return [row["id"] for row in rows]
