"""The webhook queries, shared by the SQLite and PostgreSQL stores: endpoints under their API key, and the outbox.

The outbox (docs/webhooks.md): `queue_job_event` writes a finished job's event, one delivery per subscribed
endpoint, inside the transaction that records the job's final state (sql.py), so a job is never finished without
its event nor its event sent for a job that did not finish. A delivery worker then *claims* due deliveries as the
job runners claim jobs: in one statement, under its server's name and a lease (PostgreSQL: `FOR UPDATE SKIP
LOCKED`), so two servers never send the same attempt and a dead server's deliveries are taken over once its lease
runs out. Every result is recorded only while the worker still holds the lease."""

from __future__ import annotations

import json
import time
from collections.abc import Collection
from dataclasses import fields
from typing import Any

from h3serve.jobstore.records import FINISHED, UNFINISHED
from h3serve.jobstore.sql_runner import Row, Run, SQLRunner
from h3serve.jobstore.webhook_records import (
    VIDEO_EVENTS,
    WebhookDelivery,
    WebhookEndpoint,
    event_payload,
    new_delivery_id,
    new_event_id,
)

ENDPOINT_COLUMNS = tuple(f.name for f in fields(WebhookEndpoint) if f.name != "seq")
DELIVERY_COLUMNS = tuple(f.name for f in fields(WebhookDelivery) if f.name != "seq")
_DONE_SQL = "('delivered', 'failed')"
ENDPOINT_DELETED = "the webhook endpoint was deleted"


def endpoint_from_row(row: Row) -> WebhookEndpoint:
    values = {name: row[name] for name in ENDPOINT_COLUMNS}
    values["event_types"] = tuple(json.loads(row["event_types"]))
    return WebhookEndpoint(seq=row["seq"], **values)


def delivery_from_row(row: Row) -> WebhookDelivery:
    return WebhookDelivery(seq=row["seq"], **{name: row[name] for name in DELIVERY_COLUMNS})


def _endpoint_values(endpoint: WebhookEndpoint) -> tuple[Any, ...]:
    return tuple(json.dumps(list(endpoint.event_types)) if name == "event_types" else getattr(endpoint, name)
                 for name in ENDPOINT_COLUMNS)


def queue_job_event(run: Run, job: Row, now: float) -> int:
    """Write the event of a job that has just reached its final state (or, unfinished, was deleted), one delivery
    per endpoint of its API key that subscribes to it; the deliveries written. Called inside the transaction that
    recorded the state, with the job's row (`id`, `status`, `sync`, `key_scope`, `completed_at`).

    A sync job sends none: its client holds the answer. A deleted unfinished job sends `video.failed` (OpenAI's
    SDK names no cancellation event for videos)."""
    if job["sync"]:
        return 0
    status = job["status"]
    event_type = VIDEO_EVENTS["failed"] if status in UNFINISHED else VIDEO_EVENTS.get(status)
    if event_type is None:
        return 0
    endpoints = run("SELECT id, event_types FROM webhook_endpoints WHERE key_scope = ? ORDER BY seq",
                    (job["key_scope"],))
    targets = [row["id"] for row in endpoints if event_type in json.loads(row["event_types"])]
    if not targets:
        return 0
    event_id = new_event_id()
    created_at = int(job["completed_at"] if status in FINISHED and job["completed_at"] is not None else now)
    payload = event_payload(event_id, event_type, job["id"], created_at)
    placeholders = ", ".join("?" for _ in DELIVERY_COLUMNS)
    for endpoint_id in targets:
        delivery = WebhookDelivery(
            id=new_delivery_id(), event_id=event_id, event_type=event_type, video_id=job["id"],
            endpoint_id=endpoint_id, key_scope=job["key_scope"], payload=payload, created_at=created_at,
            next_attempt_at=now,
        )
        run(f"INSERT INTO webhook_deliveries ({', '.join(DELIVERY_COLUMNS)}) VALUES ({placeholders})",
            tuple(getattr(delivery, name) for name in DELIVERY_COLUMNS))
    return len(targets)


class WebhookSQL(SQLRunner):
    """The webhook half of `h3serve.jobstore.store.JobStore` (mixed into `SQLJobStore`)."""

    # -- endpoints -------------------------------------------------------------------------------------------

    def insert_endpoint(self, endpoint: WebhookEndpoint, max_per_key: int) -> WebhookEndpoint | None:
        """Store a new endpoint with its `seq`; None (nothing stored) when its key has `max_per_key` already."""

        def insert(run: Run) -> WebhookEndpoint | None:
            count = run("SELECT COUNT(*) AS n FROM webhook_endpoints WHERE key_scope = ?", (endpoint.key_scope,))
            if int(count[0]["n"]) >= max_per_key:
                return None
            placeholders = ", ".join("?" for _ in ENDPOINT_COLUMNS)
            rows = run(f"INSERT INTO webhook_endpoints ({', '.join(ENDPOINT_COLUMNS)}) VALUES ({placeholders}) "
                       "RETURNING *", _endpoint_values(endpoint))
            return endpoint_from_row(rows[0])

        return self._atomic(insert)

    def get_endpoint(self, key_scope: str, endpoint_id: str) -> WebhookEndpoint | None:
        rows = self._run("SELECT * FROM webhook_endpoints WHERE id = ? AND key_scope = ?", (endpoint_id, key_scope))
        return endpoint_from_row(rows[0]) if rows else None

    def page_endpoints(self, key_scope: str, after: str | None, limit: int) -> tuple[list[WebhookEndpoint], bool]:
        """The key's endpoints newest first, `limit` after the cursor endpoint (unknown: an empty page); has_more."""
        sql, params = "SELECT * FROM webhook_endpoints WHERE key_scope = ?", [key_scope]
        if after is not None:
            sql += " AND seq < (SELECT seq FROM webhook_endpoints WHERE id = ? AND key_scope = ?)"
            params += [after, key_scope]
        rows = self._run(f"{sql} ORDER BY seq DESC LIMIT ?", (*params, limit + 1))
        return [endpoint_from_row(r) for r in rows[:limit]], len(rows) > limit

    def update_endpoint(self, key_scope: str, endpoint_id: str, now: int, name: str | None = None,
                        url: str | None = None, event_types: tuple[str, ...] | None = None) -> WebhookEndpoint | None:
        """Change the given fields; `updated_at` moves to `now` only if one of them changed. None: no such endpoint."""
        types = None if event_types is None else json.dumps(list(event_types))
        rows = self._run(
            "UPDATE webhook_endpoints SET updated_at = CASE WHEN name = COALESCE(?, name) AND url = COALESCE(?, url) "
            "AND event_types = COALESCE(?, event_types) THEN updated_at ELSE ? END, name = COALESCE(?, name), "
            "url = COALESCE(?, url), event_types = COALESCE(?, event_types) WHERE id = ? AND key_scope = ? "
            "RETURNING *",
            (name, url, types, now, name, url, types, endpoint_id, key_scope),
        )
        return endpoint_from_row(rows[0]) if rows else None

    def rotate_endpoint_secret(self, key_scope: str, endpoint_id: str, secret: str, hint: str, now: int,
                               keep_old_until: int | None) -> WebhookEndpoint | None:
        """Sign with `secret` from now on; the old one stays valid until `keep_old_until` (None: not at all)."""
        rows = self._run(
            "UPDATE webhook_endpoints SET previous_secret = CASE WHEN ? = 1 THEN secret ELSE NULL END, "
            "previous_secret_expires_at = ?, secret = ?, secret_hint = ?, updated_at = ? "
            "WHERE id = ? AND key_scope = ? RETURNING *",
            (int(keep_old_until is not None), keep_old_until, secret, hint, now, endpoint_id, key_scope),
        )
        return endpoint_from_row(rows[0]) if rows else None

    def delete_endpoint(self, key_scope: str, endpoint_id: str) -> bool:
        """Remove the endpoint; its pending deliveries fail (nobody is left to send them to)."""

        def delete(run: Run) -> bool:
            if not run("DELETE FROM webhook_endpoints WHERE id = ? AND key_scope = ? RETURNING id",
                       (endpoint_id, key_scope)):
                return False
            run("UPDATE webhook_deliveries SET state = 'failed', last_error = ?, owner = NULL, "
                "lease_expires_at = NULL WHERE endpoint_id = ? AND state = 'pending'", (ENDPOINT_DELETED, endpoint_id))
            return True

        return self._atomic(delete)

    # -- the outbox ------------------------------------------------------------------------------------------

    def claim_deliveries(self, owner: str, lease_s: float, limit: int
                         ) -> list[tuple[WebhookDelivery, WebhookEndpoint | None]]:
        """Take up to `limit` due deliveries for `owner` (leased until now + `lease_s`, one more attempt counted),
        each with its endpoint (None: deleted meanwhile). Due: pending, its next attempt's time come, and not
        leased, or leased by a server whose lease ran out (it died mid-attempt)."""
        if limit <= 0:
            return []
        now = time.time()
        rows = self._run(
            "UPDATE webhook_deliveries SET owner = ?, lease_expires_at = ?, attempts = attempts + 1, "
            "last_attempt_at = ? WHERE seq IN (SELECT seq FROM webhook_deliveries WHERE state = 'pending' "
            "AND next_attempt_at <= ? AND (owner IS NULL OR lease_expires_at IS NULL OR lease_expires_at < ?) "
            f"ORDER BY next_attempt_at, seq LIMIT ? {self.lock_clause}) RETURNING *",
            (owner, now + lease_s, now, now, now, limit),
        )
        deliveries = sorted((delivery_from_row(r) for r in rows), key=lambda d: d.seq)
        endpoints = self._endpoints({d.endpoint_id for d in deliveries})
        return [(d, endpoints.get(d.endpoint_id)) for d in deliveries]

    def _endpoints(self, ids: Collection[str]) -> dict[str, WebhookEndpoint]:
        if not ids:
            return {}
        marks = ", ".join("?" for _ in ids)
        rows = self._run(f"SELECT * FROM webhook_endpoints WHERE id IN ({marks})", tuple(sorted(ids)))
        return {row["id"]: endpoint_from_row(row) for row in rows}

    def record_delivered(self, delivery_id: str, owner: str, status_code: int) -> bool:
        """The attempt `owner` holds was answered 2xx: delivered. False if its lease was lost meanwhile."""
        return bool(self._run(
            "UPDATE webhook_deliveries SET state = 'delivered', last_status_code = ?, last_error = NULL, "
            "delivered_at = ?, owner = NULL, lease_expires_at = NULL WHERE id = ? AND owner = ? "
            "AND state = 'pending' RETURNING id",
            (status_code, time.time(), delivery_id, owner),
        ))

    def record_attempt_failed(self, delivery_id: str, owner: str, status_code: int | None, error: str,
                              next_attempt_at: float | None) -> bool:
        """The attempt `owner` holds failed: retried at `next_attempt_at`, or (None: past its horizon) failed for
        good. False if its lease was lost meanwhile."""
        state = "pending" if next_attempt_at is not None else "failed"
        return bool(self._run(
            "UPDATE webhook_deliveries SET state = ?, last_status_code = ?, last_error = ?, "
            "next_attempt_at = COALESCE(?, next_attempt_at), owner = NULL, lease_expires_at = NULL "
            "WHERE id = ? AND owner = ? AND state = 'pending' RETURNING id",
            (state, status_code, error, next_attempt_at, delivery_id, owner),
        ))

    def deliveries_for_video(self, key_scope: str, video_id: str) -> list[WebhookDelivery]:
        rows = self._run("SELECT * FROM webhook_deliveries WHERE video_id = ? AND key_scope = ? ORDER BY seq",
                         (video_id, key_scope))
        return [delivery_from_row(r) for r in rows]

    def count_deliveries_by_state(self) -> dict[str, int]:
        rows = self._run("SELECT state, COUNT(*) AS n FROM webhook_deliveries GROUP BY state")
        return {row["state"]: int(row["n"]) for row in rows}

    def release_deliveries(self) -> None:
        """Every pending delivery unleased: for a store only this process uses, at start-up (a killed process's
        attempt is made again at once rather than after its lease)."""
        self._run("UPDATE webhook_deliveries SET owner = NULL, lease_expires_at = NULL WHERE state = 'pending'")

    def prune_webhooks(self, now: float, retention_s: float) -> int:
        """Forget rotated-out secrets past their grace and finished deliveries older than `retention_s`; the
        deliveries removed."""
        self._run("UPDATE webhook_endpoints SET previous_secret = NULL, previous_secret_expires_at = NULL "
                  "WHERE previous_secret_expires_at IS NOT NULL AND previous_secret_expires_at <= ?", (int(now),))
        rows = self._run(f"DELETE FROM webhook_deliveries WHERE state IN {_DONE_SQL} AND created_at < ? RETURNING id",
                         (int(now - retention_s),))
        return len(rows)
