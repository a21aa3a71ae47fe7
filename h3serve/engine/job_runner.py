"""A replica's runner thread: claim the next queued job from the store under a lease, run it on the replica's
executor, and hand its output to the finisher (output overlap: the MP4 is written while the runner takes the next
job) or write it before the next one (`overlap_output=False`)."""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

from h3serve.engine.job_book import ActiveJob
from h3serve.engine.job_outcome import drop, finish, job_error, record_failure, write_and_finish
from h3serve.engine.output import GenerationOutput
from h3serve.engine.planning import plan_request
from h3serve.jobstore.records import Job
from h3serve.media.intake import MediaError
from h3serve.rules.validate import GenerationPlan, RequestError

if TYPE_CHECKING:
    from h3serve.engine.jobs import JobManager

log = logging.getLogger("h3serve.jobs")


def run_forever(manager: JobManager, replica: int) -> None:
    """The runner thread of `replica`: one job at a time, in queue order, until the manager stops."""
    try:
        while (claimed := _claim(manager, replica)) is not None:
            job, active = claimed
            waited = max(0.0, manager.clock() - job.created_at)
            for listener in manager.book.start_listeners:
                try:
                    listener(replica, waited)
                except Exception:
                    log.exception("job start listener failed")
            output = None
            try:
                plan = _plan_for(manager, job, active)
                if plan is not None:
                    output = _run(manager, active, plan)
            except Exception as e:  # whatever a run raises ends that job, never the runner
                record_failure(manager, active, e)
            if output is not None and manager.overlap_output:
                _hand_off(manager, active, output)  # written while this runner takes the next job
            else:
                if output is not None:
                    write_and_finish(manager, active, output)
                _release(manager, active)
    finally:
        finisher = manager.book.finishers.get(replica)
        if finisher is not None:
            finisher.join()  # the runner ends once its last output is written


def _claim(manager: JobManager, replica: int) -> tuple[Job, ActiveJob] | None:
    """The next job for `replica`, registered as active (under the lock, so a delete sees it), or None
    after waiting for a wake-up; None also once stopping."""
    with manager.book.cond:
        while not manager.book.stopping:
            seen = manager.book.wakeups
            try:
                job = manager.store.claim(manager.owner, manager.lease_s)
            except Exception:
                log.exception("claiming a job from the store failed; retrying")
                job = None
            if job is not None and manager.book.find(job.id) is not None:
                # Our own running job, its lease run out (a heartbeat held up): the claim renewed it.
                log.warning("job %s: lease ran out while running here; renewed", job.id)
            elif job is not None:
                active = manager.book.active[replica] = ActiveJob(job.id, replica)
                return job, active
            if manager.book.wakeups == seen:
                manager.book.cond.wait(manager.poll_s)
        return None


def _hand_off(manager: JobManager, active: ActiveJob, output: GenerationOutput) -> None:
    """Give the job to the replica's finisher thread (after its previous one is written) and free the replica."""
    replica = active.replica
    previous = manager.book.finishers.get(replica)
    if previous is not None:
        previous.join()  # one job finishing per replica: bounded memory, outcomes recorded in order

    def write_then_release() -> None:
        try:
            write_and_finish(manager, active, output)
        finally:
            _release(manager, active)

    with manager.book.cond:
        del manager.book.active[replica]
        manager.book.finishing[replica] = active
    thread = threading.Thread(target=write_then_release, name=f"h3serve-job-finisher-{replica}", daemon=True)
    manager.book.finishers[replica] = thread
    thread.start()


def _release(manager: JobManager, active: ActiveJob) -> None:
    """The job leaves this server's hands: remove a deleted job's files, count it, wake its waiters."""
    with manager.book.cond:
        if active.deleted:
            manager.files.remove(active.job_id)
        replica = active.replica
        if manager.book.active.get(replica) is active:
            del manager.book.active[replica]
        if manager.book.finishing.get(replica) is active:
            del manager.book.finishing[replica]
        manager.book.served[replica] += 1
        manager.book.plans.pop(active.job_id, None)
        manager.book.finish_waiters(active.job_id)  # after the outcome is stored: a sync waiter reads it next
        manager.book.cond.notify_all()  # a drain waits for the held jobs


def _plan_for(manager: JobManager, job: Job, active: ActiveJob) -> GenerationPlan | None:
    """The job's plan: the one made at submission, else planned again (a job submitted to another server,
    or before a restart); None after failing the job when its request no longer plans."""
    plan = manager.book.plans.get(job.id)
    if plan is not None:
        return plan
    try:
        return plan_request(job.request, manager.defaults, manager.tasks)
    except (RequestError, MediaError) as e:  # the model or the input files changed under the job
        finish(manager, active, status="failed", error=job_error(e))
        return None


def _run(manager: JobManager, active: ActiveJob, plan: GenerationPlan) -> GenerationOutput | None:
    """The engine run of the job; its output, or None when the job was dropped meanwhile."""
    executor = manager.executors[active.replica]
    job_id = active.job_id
    reported = [0]

    def on_start(seq: int) -> None:
        with manager.book.cond:
            active.seq = seq
            active.last_progress = time.monotonic()
            if active.dropped or manager.book.stopping:
                executor.cancel(seq)

    def on_progress(done: int, total: int) -> None:
        active.last_progress = time.monotonic()
        percent = min(99, done * 100 // max(total, 1))  # 100 only once the files are written
        if percent > reported[0]:
            reported[0] = percent
            with manager.book.cond:
                if active.dropped:
                    return
                try:
                    held = manager.store.update_owned(job_id, manager.owner, progress=percent)
                except Exception:  # the database is briefly away: the lease decides, not a progress tick
                    log.warning("job %s: recording progress failed", job_id, exc_info=True)
                    return
                if not held:
                    drop(manager, active)

    output = executor.generate(
        plan,
        on_progress=on_progress,
        on_start=on_start,
        timeout_s=manager.job_timeout_s,
        encoder=manager.encoder_options,
    )
    manager.book.counters[active.replica] = dict(output.counters)
    return None if active.dropped else output
