"""The lease keeper: a server renews the leases of the jobs it holds every third of a lease, so a job whose server
died is claimed again once its lease runs out, and a run whose job was deleted or claimed elsewhere stops at its
next step."""

from __future__ import annotations

import logging

from h3serve.engine.jobs.book import JobBook
from h3serve.engine.jobs.outcomes import Outcomes
from h3serve.engine.jobs.publishing import Publisher
from h3serve.engine.jobs.types import JobPolicy
from h3serve.jobstore.records import FINISHED
from h3serve.jobstore.store import JobStore

log = logging.getLogger("h3serve.jobs")


class LeaseKeeper:
    """Renews one manager's leases and notices the jobs it no longer holds."""

    def __init__(self, store: JobStore, publisher: Publisher, book: JobBook, outcomes: Outcomes, policy: JobPolicy):
        self.store = store
        self.publisher = publisher
        self.book = book
        self.outcomes = outcomes
        self.policy = policy

    def heartbeat_forever(self) -> None:
        """The heartbeat thread's body, until the book's background stop."""
        while not self.book.stop_background.wait(self.policy.lease_s / 3):
            try:
                self.renew()
            except Exception:
                log.exception(
                    "renewing the job leases failed (the jobs run on; another server may claim "
                    "them once the leases run out)"
                )

    def renew(self) -> None:
        """Renew this server's leases; stop runs whose job was deleted or claimed elsewhere. On a shared store
        also delete orphaned sync jobs and forget jobs submitted here that another server finished."""
        book, store, owner = self.book, self.store, self.policy.owner
        with book.cond:  # the jobs this server runs, and its sync jobs (their clients wait here)
            mine = {a.job_id for a in book.held()} | book.waited_on()
        held = store.renew(owner, self.policy.lease_s, mine)
        with book.cond:
            for active in book.held():
                if active.job_id not in held and not active.dropped:
                    self.outcomes.drop(active)
        if not store.shared:
            return
        for job_id in store.reap_orphaned_sync():
            self.publisher.forget(job_id)
        with book.cond:
            running = {a.job_id for a in book.held()}
            tracked = [j for j in book.tracked() if j not in running]
        for job_id in tracked:
            job = store.get(job_id)
            if job is None or job.status in FINISHED or job.owner not in (None, owner):
                book.forget(job_id)
