"""Versioned schema migrations, applied in order at start-up; the applied version is kept in `schema_version`.

Each migration is a list of statements per dialect. A database newer than this h3serve is refused (an older
h3serve must not write rows it does not understand)."""

from __future__ import annotations

from typing import Literal

Dialect = Literal["sqlite", "postgresql"]

_V1_JOBS = """
CREATE TABLE IF NOT EXISTS jobs (
    seq {seq},
    id TEXT NOT NULL UNIQUE,
    model TEXT NOT NULL,
    request TEXT NOT NULL,
    created_at BIGINT NOT NULL,
    size TEXT NOT NULL,
    seconds TEXT NOT NULL,
    num_frames INTEGER NOT NULL,
    fps INTEGER NOT NULL,
    duration_s {real} NOT NULL,
    status TEXT NOT NULL,
    progress INTEGER NOT NULL,
    completed_at BIGINT,
    expires_at BIGINT,
    stage_durations TEXT NOT NULL,
    peak_memory_mb {real} NOT NULL,
    inference_time_s {real},
    error TEXT,
    sync INTEGER NOT NULL,
    expired INTEGER NOT NULL
)"""
_TYPES: dict[Dialect, dict[str, str]] = {
    "sqlite": {"seq": "INTEGER PRIMARY KEY AUTOINCREMENT", "real": "REAL"},
    "postgresql": {"seq": "BIGSERIAL PRIMARY KEY", "real": "DOUBLE PRECISION"},
}


# 3: `num_inference_steps` counts denoiser forwards (N forwards over N + 1 sigma points); a request stored before
# counted sigma points (M points, M - 1 forwards). Each stored `steps` becomes its forward count, so a job queued
# before an upgrade runs the forwards it was submitted for, and a remix of an older video keeps its schedule.
# (1 was the least either count allowed; a 1 stays 1.)
_STEPS_AS_FORWARDS: dict[Dialect, str] = {
    "sqlite": "UPDATE jobs SET request = json_set(request, '$.steps', MAX(1, json_extract(request, '$.steps') - 1)) "
    "WHERE json_extract(request, '$.steps') IS NOT NULL",
    "postgresql": "UPDATE jobs SET request = jsonb_set(request::jsonb, '{steps}', "
    "to_jsonb(GREATEST(1, (request::jsonb ->> 'steps')::integer - 1)))::text "
    "WHERE request::jsonb ->> 'steps' IS NOT NULL",
}


# 6: webhooks (docs/webhooks.md): the endpoints, each under the API key that made it, and the outbox of deliveries,
# written in the transaction that records a job's final state; a job remembers its key to find its endpoints.
_V6_WEBHOOK_ENDPOINTS = """
CREATE TABLE IF NOT EXISTS webhook_endpoints (
    seq {seq},
    id TEXT NOT NULL UNIQUE,
    key_scope TEXT NOT NULL,
    name TEXT NOT NULL,
    url TEXT NOT NULL,
    event_types TEXT NOT NULL,
    created_at BIGINT NOT NULL,
    updated_at BIGINT NOT NULL,
    secret TEXT NOT NULL,
    secret_hint TEXT NOT NULL,
    previous_secret TEXT,
    previous_secret_expires_at BIGINT
)"""
_V6_WEBHOOK_DELIVERIES = """
CREATE TABLE IF NOT EXISTS webhook_deliveries (
    seq {seq},
    id TEXT NOT NULL UNIQUE,
    event_id TEXT NOT NULL,
    event_type TEXT NOT NULL,
    video_id TEXT NOT NULL,
    endpoint_id TEXT NOT NULL,
    key_scope TEXT NOT NULL,
    payload TEXT NOT NULL,
    created_at BIGINT NOT NULL,
    state TEXT NOT NULL,
    attempts INTEGER NOT NULL,
    next_attempt_at {real} NOT NULL,
    owner TEXT,
    lease_expires_at {real},
    last_attempt_at {real},
    last_status_code INTEGER,
    last_error TEXT,
    delivered_at {real}
)"""


def _migrations(dialect: Dialect) -> list[list[str]]:
    t = _TYPES[dialect]
    return [
        # 1: the job table (h3serve 0.1's SQLite store, recorded there as PRAGMA user_version 1).
        [_V1_JOBS.format(**t), "CREATE INDEX IF NOT EXISTS jobs_status ON jobs (status)"],
        # 2: leases, so several servers can share one queue, and a completion counter (exactly-once check).
        [
            "ALTER TABLE jobs ADD COLUMN owner TEXT",
            f"ALTER TABLE jobs ADD COLUMN lease_expires_at {t['real']}",
            "ALTER TABLE jobs ADD COLUMN completions INTEGER NOT NULL DEFAULT 0",
            "CREATE INDEX IF NOT EXISTS jobs_owner ON jobs (owner)",
        ],
        [_STEPS_AS_FORWARDS[dialect]],
        # 4: the forwards a job's progress counts (steps x generated windows): a page can name the step of a long
        # video's whole run. Older rows hold 0 (not recorded).
        ["ALTER TABLE jobs ADD COLUMN progress_steps INTEGER NOT NULL DEFAULT 0"],
        # 5: several outputs of one prompt; a job of N counts N toward the queue bound. Older rows made one.
        ["ALTER TABLE jobs ADD COLUMN num_outputs INTEGER NOT NULL DEFAULT 1"],
        [
            "ALTER TABLE jobs ADD COLUMN key_scope TEXT NOT NULL DEFAULT ''",
            _V6_WEBHOOK_ENDPOINTS.format(**t),
            "CREATE INDEX IF NOT EXISTS webhook_endpoints_scope ON webhook_endpoints (key_scope, seq)",
            _V6_WEBHOOK_DELIVERIES.format(**t),
            "CREATE INDEX IF NOT EXISTS webhook_deliveries_due ON webhook_deliveries (state, next_attempt_at)",
            "CREATE INDEX IF NOT EXISTS webhook_deliveries_video ON webhook_deliveries (video_id)",
        ],
        # 7: every stage's start and end (JSON [[stage, start, end], ...]). Older rows recorded none.
        ["ALTER TABLE jobs ADD COLUMN stage_timeline TEXT NOT NULL DEFAULT '[]'"],
    ]


LATEST = len(_migrations("sqlite"))


def pending(dialect: Dialect, current: int, where: str) -> list[tuple[int, list[str]]]:
    """(version, statements) of each migration after `current`; `RuntimeError` if `current` is newer."""
    if current > LATEST:
        raise RuntimeError(f"{where}: job store schema {current} is newer than this h3serve ({LATEST})")
    return [(version, statements) for version, statements in enumerate(_migrations(dialect), 1) if version > current]


SCHEMA_VERSION_TABLE = "CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)"
