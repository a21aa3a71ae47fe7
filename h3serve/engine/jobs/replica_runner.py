"""A replica's runner: claim the next queued job from the store under a lease, run it on the replica's executor,
and hand its output to the finisher thread (output overlap: the MP4 is written while the runner takes the next
job) or write it before the next one (`overlap_output=False`); then publish it (publishing.py: into a bucket by
the upload pool, while both go on). A claimed job whose outputs were staged here before is only published."""

from __future__ import annotations

import logging
import threading

from h3serve.engine.jobs.book import ActiveJob, JobBook
from h3serve.engine.jobs.outcomes import Outcomes, job_error
from h3serve.engine.jobs.publishing import Publisher
from h3serve.engine.jobs.shared_inputs import SharedInputs
from h3serve.engine.jobs.types import ExecutorLike, JobPolicy, Replanner
from h3serve.jobstore.records import Job, JobError
from h3serve.jobstore.store import JobStore
from h3serve.media.media_inputs import MediaError
from h3serve.messages import GenerationOutput
from h3serve.output_store.interface import OutputMissing, OutputStoreUnavailable
from h3serve.rules.validate import GenerationPlan, RequestError

log = logging.getLogger("h3serve.jobs")


class ReplicaRunner:
    """The runner of replica `replica`: one job at a time, in queue order, until the book says stopping."""

    def __init__(
        self,
        replica: int,
        executor: ExecutorLike,
        store: JobStore,
        publisher: Publisher,
        inputs: SharedInputs,
        book: JobBook,
        outcomes: Outcomes,
        policy: JobPolicy,
        replan: Replanner,
    ):
        self.replica = replica
        self.executor = executor
        self.store = store
        self.publisher = publisher
        self.inputs = inputs
        self.book = book
        self.outcomes = outcomes
        self.policy = policy
        self.replan = replan

    def run_forever(self) -> None:
        """The runner thread's body."""
        try:
            while (claimed := self._claim()) is not None:
                job, active = claimed
                waited = max(0.0, self.policy.clock() - job.created_at)
                for listener in self.book.start_listeners:
                    try:
                        listener(self.replica, waited)
                    except Exception:
                        log.exception("job start listener failed")
                output = None
                try:
                    staged = self.publisher.staged(job.id)
                    if staged is not None:  # written before this server stopped or died, mid-upload
                        log.info("job %s: its outputs were written before; publishing them", job.id)
                        self.publisher.publish(active, staged, self._release)
                        continue
                    plan = self._plan_for(job, active)
                    if plan is not None:
                        output = self._run(active, plan)
                except Exception as e:  # whatever a run raises ends that job, never the runner
                    self.outcomes.record_failure(active, e)
                if output is not None and self.policy.overlap_output:
                    self._hand_off(active, output)  # written while this runner takes the next job
                elif output is not None:
                    self._finish(active, output)
                else:
                    self._release(active)
        finally:
            finisher = self.book.finisher_of(self.replica)
            if finisher is not None:
                finisher.join()  # the runner ends once its last output is written

    def _claim(self) -> tuple[Job, ActiveJob] | None:
        """The next job for this replica, registered as active (under the lock, so a delete sees it), or None
        after waiting for a wake-up; None also once stopping. None is claimed while a session holds the replica."""
        book = self.book
        with book.cond:
            while not book.stopping:
                seen = book.wakeups
                if book.in_session(self.replica):  # a real-time session holds the replica: no job until it ends
                    book.cond.wait(self.policy.poll_s)
                    continue
                try:
                    job = self.store.claim(self.policy.owner, self.policy.lease_s)
                except Exception:
                    log.exception("claiming a job from the store failed; retrying")
                    job = None
                if job is not None and book.find(job.id) is not None:
                    # Our own running job, its lease run out (a heartbeat held up): the claim renewed it.
                    log.warning("job %s: lease ran out while running here; renewed", job.id)
                elif job is not None:
                    return job, book.claim(self.replica, job.id)
                if book.wakeups == seen:
                    book.cond.wait(self.policy.poll_s)
            return None

    def _hand_off(self, active: ActiveJob, output: GenerationOutput) -> None:
        """Give the job to the replica's finisher thread (after its previous one is written) and free the replica."""
        previous = self.book.finisher_of(self.replica)
        if previous is not None:
            previous.join()  # one job finishing per replica: bounded memory, outcomes recorded in order

        thread = threading.Thread(target=self._finish, args=(active, output),
                                  name=f"h3serve-job-finisher-{self.replica}", daemon=True)
        self.book.hand_off(self.replica, active, thread)
        thread.start()

    def _finish(self, active: ActiveJob, output: GenerationOutput) -> None:
        """Write the job's files, then publish them; the job is released once recorded (by the upload pool when
        they go to a bucket). Never raises."""
        staged = None
        try:
            staged = self.outcomes.write(active, output)
        finally:
            if staged is None:
                self._release(active)
        if staged is not None:
            self.publisher.publish(active, staged, self._release)

    def _release(self, active: ActiveJob) -> None:
        """The job leaves this server's hands: remove a deleted job's files (here and in a bucket), count it, wake
        its waiters."""
        if active.deleted:
            self.publisher.forget(active.job_id)
        self.book.release(self.replica, active)

    def _plan_for(self, job: Job, active: ActiveJob) -> GenerationPlan | None:
        """The job's plan: the one made at submission, else planned again (a job submitted to another server,
        whose inputs are fetched from the bucket, or before a restart); None after failing the job when its request
        no longer plans or its inputs cannot be fetched."""
        plan = self.book.plan_of(job.id)
        if plan is not None:
            return plan
        try:
            return self.replan(self.inputs.localized(job))
        except (RequestError, MediaError) as e:  # the model or the input files changed under the job
            self.outcomes.finish(active, status="failed", error=job_error(e))
        except OutputMissing:
            self.outcomes.finish(active, status="failed", error=JobError(
                "invalid_media", "the job's input files are missing from the output store"))
        except OutputStoreUnavailable as e:
            self.outcomes.finish(active, status="failed", error=JobError(
                e.code, f"fetching the job's input files from the output store failed: {e.reason}"))
        return None

    def _run(self, active: ActiveJob, plan: GenerationPlan) -> GenerationOutput | None:
        """The engine run of the job; its output, or None when the job was dropped meanwhile."""
        executor, book = self.executor, self.book
        job_id = active.job_id
        reported = [0]

        def on_start(seq: int) -> None:
            with book.cond:
                if book.started(active, seq):
                    executor.cancel(seq)

        def on_progress(done: int, total: int) -> None:
            book.progressed(active)
            percent = min(99, done * 100 // max(total, 1))  # 100 only once the files are written
            if percent > reported[0]:
                reported[0] = percent
                with book.cond:
                    if active.dropped:
                        return
                    try:
                        held = self.store.update_owned(job_id, self.policy.owner, progress=percent)
                    except Exception:  # the database is briefly away: the lease decides, not a progress tick
                        log.warning("job %s: recording progress failed", job_id, exc_info=True)
                        return
                    if not held:
                        self.outcomes.drop(active)

        active.encoder = self.policy.encoder_options.for_request(plan.video_preset, plan.video_crf)
        output = executor.generate(
            plan,
            on_progress=on_progress,
            on_start=on_start,
            timeout_s=self.policy.job_timeout_s,
            encoder=active.encoder,
        )
        book.record_counters(self.replica, output.counters)
        return None if active.dropped else output
