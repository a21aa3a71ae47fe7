"""Recovery at start-up and expiry: a restarted server finds its stored queue again (finished jobs stay
finished, unfinished ones run again from the start, in order), and a TTL sweeper deletes expired outputs."""

from __future__ import annotations

import logging

from h3serve.engine.jobs.book import JobBook
from h3serve.engine.jobs.outcomes import job_error
from h3serve.engine.jobs.publishing import Publisher
from h3serve.engine.jobs.types import JobPolicy, Replanner
from h3serve.jobstore.store import JobStore
from h3serve.media.media_inputs import MediaError
from h3serve.output_store.interface import OutputStoreUnavailable
from h3serve.rules.validate import RequestError

log = logging.getLogger("h3serve.jobs")

ORPHAN_AGE_S = 3600.0  # shared data dir: a job folder without a record is removed once this old


class Recovery:
    """Makes one manager's stored queue runnable at start-up, and sweeps its expired outputs."""

    def __init__(self, store: JobStore, publisher: Publisher, book: JobBook, policy: JobPolicy, replan: Replanner):
        self.store = store
        self.publisher = publisher
        self.book = book
        self.policy = policy
        self.replan = replan

    def recover(self) -> None:
        """Make the stored queue runnable. A store only this server uses: requeue what a previous process left
        unfinished, in order (failing what no longer plans), and drop sync jobs (their clients went away with
        that process) and job folders without a record. A shared store: other servers' leases decide; only
        orphaned sync jobs and old record-less folders go."""
        store, files = self.store, self.publisher.files
        if store.shared:
            for job_id in store.reap_orphaned_sync():
                self.publisher.forget(job_id)
            orphans = files.job_ids(older_than_s=ORPHAN_AGE_S) - store.ids()
        else:
            for job in store.sync_jobs():
                store.delete(job.id)
                self.publisher.forget(job.id)
            store.release_all()
            self._requeue_unfinished()
            orphans = files.job_ids() - store.ids()  # a crash between record and folder removal
        for orphan in orphans:
            files.remove(orphan)  # a folder here only: its objects (if any) went with its record
        if dropped := self.publisher.drop_stale_staging():
            log.info("removed the staged outputs of %d job(s) published or ended elsewhere", dropped)
        self.sweep_expired()

    def _requeue_unfinished(self) -> None:
        """Plan every unfinished job again (failing those that no longer plan) and track it for its waiters."""
        recovered = 0
        for job in self.store.unfinished():
            try:
                plan = self.replan(job.request)
            except (RequestError, MediaError) as e:  # the model or the input files changed under the job
                self.store.update(job.id, status="failed", completed_at=int(self.policy.clock()), error=job_error(e))
                continue
            self.book.track(job.id, plan, wake=False)
            recovered += 1
        if recovered:
            log.info("recovered %d unfinished job(s)", recovered)

    def sweep_expired(self) -> int:
        """Delete the files of every job past its `expires_at`; the record stays, marked expired. A bucket's
        objects go first: while the bucket is unreachable the job stays unexpired and the next sweep retries."""
        swept = 0
        for job in self.store.due_to_expire(int(self.policy.clock())):
            if self.book.find(job.id) is not None:
                continue
            try:
                self.publisher.remove_published(job.id)
            except OutputStoreUnavailable as e:
                log.warning("job %s: its expired outputs stay until the next sweep: %s", job.id, e)
                continue
            with self.book.cond:
                if self.book.find(job.id) is not None:
                    continue
                self.store.update(job.id, expired=True)
            self.publisher.files.remove(job.id)
            swept += 1
        return swept

    def sweep_forever(self) -> None:
        """The TTL sweeper thread's body, until the book's background stop."""
        while not self.book.stop_background.wait(self.policy.sweep_interval_s):
            try:
                self.sweep_expired()
            except Exception:
                log.exception("TTL sweep failed")
