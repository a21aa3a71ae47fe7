"""The job book's invariants, one test each, and a fixed-seed random walk over every change it allows.

(That a lease has one holder across servers is the store's: tests/jobstore/test_store.py
`test_concurrent_claims_never_share_a_job` and `test_an_expired_lease_is_reclaimed_and_the_old_owner_cannot_record`;
two managers on one store: tests/engine/test_jobs_scale_out.py.)
"""

from __future__ import annotations

import random
import threading

import pytest
from fuzzing import fuzz_examples, fuzz_seed

from h3serve.engine.jobs.book import ActiveJob, JobBook, JobStateError

PLAN = object()  # the book stores plans, never reads them


def _finisher() -> threading.Thread:
    return threading.Thread(target=lambda: None)


def test_a_job_is_held_by_one_replica_in_one_state():
    book = JobBook(replicas=2)
    book.track("a", PLAN)
    active = book.claim(0, "a")
    with pytest.raises(JobStateError, match="already held"):
        book.claim(1, "a")
    book.hand_off(0, active, _finisher())
    assert book.running_on(0) is None and book.held() == [active]
    with pytest.raises(JobStateError, match="already held"):
        book.claim(1, "a")  # finishing is held too
    with pytest.raises(JobStateError, match="not running"):
        book.hand_off(0, active, _finisher())


def test_a_replica_runs_one_job_and_finishes_one():
    book = JobBook(replicas=1)
    first = book.claim(0, "a")
    with pytest.raises(JobStateError, match="already runs"):
        book.claim(0, "b")
    book.hand_off(0, first, _finisher())
    second = book.claim(0, "b")  # the next job runs while the first one's output is written
    with pytest.raises(JobStateError, match="still finishing"):
        book.hand_off(0, second, _finisher())
    book.release(0, first)
    book.hand_off(0, second, _finisher())


def test_a_session_holds_only_an_idle_replica_and_no_job_runs_beside_it():
    book = JobBook(replicas=2)
    book.claim(0, "a")
    assert book.reserve_session() == 1
    assert book.reserve_session() is None  # replica 0 runs a job, replica 1 holds a session
    with pytest.raises(JobStateError, match="real-time session"):
        book.claim(1, "b")
    book.release_session(1)
    assert book.claim(1, "b").replica == 1


@pytest.mark.parametrize("deleted", [True, False])
def test_a_dropped_job_never_starts(deleted):
    """Deleted (or claimed elsewhere) between the claim and the executor taking it: the run is cancelled at once."""
    book = JobBook(replicas=1)
    active = book.claim(0, "a")
    book.dropped(active, deleted=deleted)
    assert active.dropped and book.started(active, seq=7)
    assert active.seq == 7  # so a later cancel can name the run too


def test_a_stopping_book_starts_no_run():
    book = JobBook(replicas=1)
    active = book.claim(0, "a")
    book.stop()
    assert book.stopping and book.started(active, seq=1)


def test_a_job_leaves_once_counting_it_and_answering_its_waiters():
    book = JobBook(replicas=1)
    book.track("a", PLAN)
    waiter = book.waiter("a")
    active = book.claim(0, "a")
    assert not waiter.is_set() and book.plan_of("a") is PLAN
    book.release(0, active)
    assert waiter.is_set() and book.waiter("a") is None and book.plan_of("a") is None
    assert book.served(0) == 1 and book.held() == []
    with pytest.raises(JobStateError, match="not held"):
        book.release(0, active)
    assert book.served(0) == 1


def test_answering_waiters_can_keep_those_of_held_jobs():
    book = JobBook(replicas=1)
    for job in ("running", "queued"):
        book.track(job, PLAN)
    book.claim(0, "running")
    book.answer_waiters(keep_held=True)
    assert book.waiter("running") is not None and book.waiter("queued") is None


@pytest.mark.fuzz
def test_a_random_walk_of_changes_keeps_every_invariant():
    """3 replicas, 12 jobs, 4,000 random changes (recorded seed 20261206; `make fuzz` draws others): each one
    either applies or is refused with `JobStateError`, and after each the invariants hold."""
    rng = random.Random(fuzz_seed(20261206))
    replicas, jobs = 3, [f"job{i}" for i in range(12)]
    book = JobBook(replicas)
    sessions: set[int] = set()
    released: dict[str, int] = {}

    def check() -> None:
        held = book.held()
        ids = [a.job_id for a in held]
        assert len(ids) == len(set(ids)), "a job held twice"
        for replica in range(replicas):
            running = book.running_on(replica)
            assert not (running is not None and book.in_session(replica)), "a job beside a session"
            assert sum(a.replica == replica for a in held) <= 2, "more than one running and one finishing"
        assert sessions == {r for r in range(replicas) if book.in_session(r)}
        assert sum(book.served(r) for r in range(replicas)) == sum(released.values())

    for _ in range(fuzz_examples(4000)):
        op = rng.choice(["track", "claim", "start", "drop", "hand_off", "release", "session", "unsession", "forget"])
        replica, job = rng.randrange(replicas), rng.choice(jobs)
        held = book.held()
        try:
            if op == "track":
                book.track(job, PLAN)
            elif op == "claim":
                book.claim(replica, job)
            elif op == "start" and held:
                active = rng.choice(held)
                assert book.started(active, rng.randrange(100)) == (active.dropped or book.stopping)
            elif op == "drop" and held:
                book.dropped(rng.choice(held), deleted=rng.random() < 0.5)
            elif op == "hand_off" and (running := book.running_on(replica)) is not None:
                book.hand_off(replica, running, _finisher())
            elif op == "release" and held:
                active: ActiveJob = rng.choice(held)
                book.release(active.replica, active)
                released[active.job_id] = released.get(active.job_id, 0) + 1
                assert book.waiter(active.job_id) is None
            elif op == "session" and (got := book.reserve_session()) is not None:
                sessions.add(got)
            elif op == "unsession" and sessions:
                book.release_session(gone := rng.choice(sorted(sessions)))
                sessions.discard(gone)
            elif op == "forget":
                book.forget(job)
                assert book.waiter(job) is None
        except JobStateError:
            pass
        check()
    assert sum(released.values()) > 100  # the walk went through many whole lives
