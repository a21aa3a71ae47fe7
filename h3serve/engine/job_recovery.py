"""Recovery at start-up and expiry: a restarted server finds its stored queue again (finished jobs stay
finished, unfinished ones run again from the start, in order), and a TTL sweeper deletes expired outputs."""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING

from h3serve.engine.job_outcome import job_error
from h3serve.engine.planning import plan_request
from h3serve.media.intake import MediaError
from h3serve.rules.validate import RequestError

if TYPE_CHECKING:
    from h3serve.engine.jobs import JobManager

log = logging.getLogger("h3serve.jobs")

ORPHAN_AGE_S = 3600.0  # shared data dir: a job folder without a record is removed once this old


def recover(manager: JobManager) -> None:
    """Make the stored queue runnable. A store only this server uses: requeue what a previous process left
    unfinished, in order (failing what no longer plans), and drop sync jobs (their clients went away with
    that process) and job folders without a record. A shared store: other servers' leases decide; only
    orphaned sync jobs and old record-less folders go."""
    store, files = manager.store, manager.files
    if store.shared:
        for job_id in store.reap_orphaned_sync():
            files.remove(job_id)
        orphans = files.job_ids(older_than_s=ORPHAN_AGE_S) - store.ids()
    else:
        for job in store.sync_jobs():
            store.delete(job.id)
            files.remove(job.id)
        store.release_all()
        _requeue_unfinished(manager)
        orphans = files.job_ids() - store.ids()  # a crash between record and folder removal
    for orphan in orphans:
        files.remove(orphan)
    sweep_expired(manager)


def _requeue_unfinished(manager: JobManager) -> None:
    """Plan every unfinished job again (failing those that no longer plan) and track it for its waiters."""
    recovered = 0
    for job in manager.store.unfinished():
        try:
            manager.book.plans[job.id] = plan_request(job.request, manager.defaults, manager.tasks)
        except (RequestError, MediaError) as e:  # the model or the input files changed under the job
            manager.store.update(job.id, status="failed", completed_at=int(manager.clock()), error=job_error(e))
            continue
        manager.book.done[job.id] = threading.Event()
        recovered += 1
    if recovered:
        log.info("recovered %d unfinished job(s)", recovered)


def sweep_expired(manager: JobManager) -> int:
    """Delete the files of every job past its `expires_at`; the record stays, marked expired."""
    swept = 0
    for job in manager.store.due_to_expire(int(manager.clock())):
        with manager.book.cond:
            if manager.book.find(job.id) is not None:
                continue
            manager.store.update(job.id, expired=True)
        manager.files.remove(job.id)
        swept += 1
    return swept


def sweep_forever(manager: JobManager) -> None:
    while not manager.book.stop_background.wait(manager.sweep_interval_s):
        try:
            sweep_expired(manager)
        except Exception:
            log.exception("TTL sweep failed")
