"""The lease heartbeat: a server renews the leases of the jobs it holds every third of a lease, so a job whose
server died is claimed again once its lease runs out, and a run whose job was deleted or claimed elsewhere stops
at its next step."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from h3serve.engine.job_outcome import drop
from h3serve.jobstore.records import FINISHED

if TYPE_CHECKING:
    from h3serve.engine.jobs import JobManager

log = logging.getLogger("h3serve.jobs")


def heartbeat_forever(manager: JobManager) -> None:
    while not manager.book.stop_background.wait(manager.lease_s / 3):
        try:
            renew_leases(manager)
        except Exception:
            log.exception(
                "renewing the job leases failed (the jobs run on; another server may claim "
                "them once the leases run out)"
            )


def renew_leases(manager: JobManager) -> None:
    """Renew this server's leases; stop runs whose job was deleted or claimed elsewhere. On a shared store
    also delete orphaned sync jobs and forget jobs submitted here that another server finished."""
    book, store = manager.book, manager.store
    with book.cond:  # the jobs this server runs, and its sync jobs (their clients wait here)
        mine = {a.job_id for a in book.held()} | set(book.done)
    held = store.renew(manager.owner, manager.lease_s, mine)
    with book.cond:
        for active in book.held():
            if active.job_id not in held and not active.dropped:
                drop(manager, active)
    if not store.shared:
        return
    for job_id in store.reap_orphaned_sync():
        manager.files.remove(job_id)
    with book.cond:
        running = {a.job_id for a in book.held()}
        tracked = [j for j in set(book.done) | set(book.plans) if j not in running]
    for job_id in tracked:
        job = store.get(job_id)
        if job is None or job.status in FINISHED or job.owner not in (None, manager.owner):
            with book.cond:
                book.plans.pop(job_id, None)
                book.finish_waiters(job_id)
