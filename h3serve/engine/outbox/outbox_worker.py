"""The delivery worker: sends the outbox's webhook deliveries, at least once each, from its own thread.

The outbox is in the job store (h3serve/jobstore/webhook_sql.py); a job's event is written there in the transaction
that records its final state. This worker, one per server, claims due deliveries under its server's name and a lease
(as the job runners claim jobs), sends each (sender.py) and records how it went while it still holds the lease. So:

- a delivery survives restarts and `kill -9`: it stays in the store until delivered or given up; a store only this
  server uses releases its leases at start-up, and on a shared PostgreSQL store a dead server's lease runs out and
  another server's worker takes the delivery over;
- two servers never make the same attempt (the claim is one statement, `FOR UPDATE SKIP LOCKED`);
- every attempt of a delivery carries its one `webhook-id`, so a receiver can drop repeats;
- a failed attempt (no connection, a timeout, a non-2xx answer, a URL the guard now refuses) is retried with
  exponential backoff and jitter (retry.py) until the horizon, then the delivery is marked failed.

It runs on an event loop in a thread of its own: no request and no rank ever waits on a receiver. Attempts are
bounded in time (sender.py) and in number at once (`concurrency`); an attempt's deadline is shorter than its lease,
so a live server never loses a delivery it is sending.
"""

from __future__ import annotations

import asyncio
import logging
import random
import threading
import time
from collections.abc import Callable
from typing import ParamSpec, Protocol, TypeVar

from h3serve.engine.outbox.retry import RetryPolicy
from h3serve.engine.outbox.sender import AttemptResult, WebhookSender
from h3serve.jobstore.store import JobStore
from h3serve.jobstore.webhook_records import WebhookDelivery, WebhookEndpoint
from h3serve.jobstore.webhook_sql import ENDPOINT_DELETED
from h3serve.rules import limits

log = logging.getLogger("h3serve.webhooks")
DEFAULT_POLL_S = 1.0  # due retries and other servers' events are found this often (a local event wakes it at once)
DEFAULT_CONCURRENCY = 8  # attempts in flight at once
PRUNE_INTERVAL_S = 600.0
P = ParamSpec("P")
T = TypeVar("T")


class DeliveryObserver(Protocol):
    """What the worker reports (h3serve/api/prometheus.py's Metrics is one)."""

    def on_webhook_attempt(self, outcome: str, seconds: float) -> None: ...
    def on_webhook_delivered(self, latency_s: float) -> None: ...
    def on_webhook_given_up(self) -> None: ...


class OutboxWorker:
    """Claims and sends one server's share of the outbox; `start` it once, `stop` it before the store closes."""

    def __init__(
        self,
        store: JobStore,
        sender: WebhookSender,
        owner: str,
        lease_s: float,
        retry: RetryPolicy = RetryPolicy(),  # noqa: B008 (frozen)
        poll_s: float = DEFAULT_POLL_S,
        concurrency: int = DEFAULT_CONCURRENCY,
        observer: DeliveryObserver | None = None,
        rng: random.Random | None = None,
    ):
        self.store = store
        self.sender = sender
        self.owner = owner
        self.lease_s = lease_s
        self.retry = retry
        self.poll_s = poll_s
        self.concurrency = concurrency
        self.observer = observer
        self.rng = rng or random.Random()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wakeup: asyncio.Event | None = None
        self._stopping = threading.Event()
        self._started = threading.Event()
        self._store_failing = False  # the last store call failed (logged once per outage)

    # -- lifecycle (any thread) ------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the worker thread. A store only this server uses first releases the leases a killed process
        left, so their deliveries are attempted again at once."""
        if not self.store.shared:
            self.store.release_deliveries()
        self._thread = threading.Thread(target=self._run, name="h3serve-webhook-outbox", daemon=True)
        self._thread.start()
        self._started.wait(10)

    def wake(self, *_: object) -> None:
        """Look for due deliveries now (a job has just finished here). Thread-safe; a job listener."""
        loop, wakeup = self._loop, self._wakeup
        if loop is not None and wakeup is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(wakeup.set)
            except RuntimeError:  # the loop closed meanwhile
                pass

    def stop(self, timeout_s: float | None = None) -> bool:
        """Claim nothing more, let the attempts in flight finish (each ends within the sender's timeout), then
        end the thread; True once it has. An attempt still running at `timeout_s` is abandoned: its lease runs
        out (a store only this server uses releases it at the next start)."""
        self._stopping.set()
        self.wake()
        if self._thread is None:
            return True
        self._thread.join(self.sender.timeout_s + 5 if timeout_s is None else timeout_s)
        return not self._thread.is_alive()

    # -- the loop (its own thread) ---------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except Exception:
            log.exception("the webhook delivery worker stopped unexpectedly")

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._wakeup = asyncio.Event()
        self._started.set()
        in_flight: set[asyncio.Task[None]] = set()
        pruned_at = 0.0
        while not self._stopping.is_set():
            self._wakeup.clear()  # before claiming: a wake that comes after the claim is not lost
            if time.monotonic() - pruned_at > PRUNE_INTERVAL_S:
                pruned_at = time.monotonic()
                await self._store_call("pruning old deliveries", self.store.prune_webhooks, time.time(),
                                       limits.WEBHOOK_RETENTION_S)
            free = self.concurrency - len(in_flight)
            claimed = await self._store_call("claiming deliveries", self.store.claim_deliveries, self.owner,
                                             self.lease_s, free) if free > 0 else None
            for delivery, endpoint in claimed or []:
                task = asyncio.create_task(self._attempt(delivery, endpoint))
                in_flight.add(task)
                task.add_done_callback(in_flight.discard)
            if claimed and len(claimed) == free:
                await asyncio.wait(in_flight, return_when=asyncio.FIRST_COMPLETED)  # more may be due: a slot first
                continue
            waiter = asyncio.create_task(self._wakeup.wait())
            await asyncio.wait({waiter, *in_flight}, timeout=self.poll_s, return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()
        if in_flight:
            await asyncio.wait(in_flight, timeout=self.sender.timeout_s + 1)

    async def _store_call(self, what: str, call: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T | None:
        """A store call in a worker thread (the loop keeps sending); a failure reads as None and is logged once
        until the store answers again (a database outage must not log a line per poll)."""
        try:
            result = await asyncio.to_thread(call, *args, **kwargs)
        except Exception as e:  # the database is away: the next poll tries again, the leases keep the rest safe
            if not self._store_failing:
                log.warning("webhook outbox: %s failed (%s); retrying every %g s", what, type(e).__name__,
                            self.poll_s)
            self._store_failing = True
            return None
        if self._store_failing:
            log.info("webhook outbox: the job store answers again")
            self._store_failing = False
        return result

    async def _attempt(self, delivery: WebhookDelivery, endpoint: WebhookEndpoint | None) -> None:
        if endpoint is None:  # deleted after the event was written
            await self._store_call("recording a delivery", self.store.record_attempt_failed, delivery.id,
                                   self.owner, None, ENDPOINT_DELETED, None)
            return
        started = time.monotonic()
        try:
            result = await self.sender.send(endpoint.url, delivery.id, delivery.payload,
                                             endpoint.signing_secrets(time.time()))
        except Exception:  # a bug, not the receiver: retried like a failed attempt
            log.exception("webhook %s: the attempt raised", delivery.id)
            result = AttemptResult("connection_error", error="the attempt failed inside the server")
        if self.observer is not None:
            self.observer.on_webhook_attempt(result.outcome, time.monotonic() - started)
        await self._record(delivery, endpoint, result)

    async def _record(self, delivery: WebhookDelivery, endpoint: WebhookEndpoint, result: AttemptResult) -> None:
        now = time.time()
        if result.delivered and result.status_code is not None:
            recorded = await self._store_call("recording a delivery", self.store.record_delivered, delivery.id,
                                              self.owner, result.status_code)
            if recorded and self.observer is not None:
                self.observer.on_webhook_delivered(now - delivery.created_at)
            return
        retry_at = self.retry.next_attempt_at(delivery.created_at, delivery.attempts, now, self.rng)
        await self._store_call("recording a failed attempt", self.store.record_attempt_failed, delivery.id,
                               self.owner, result.status_code, result.error or result.outcome, retry_at)
        if retry_at is None:
            log.warning("webhook %s (%s for %s) to endpoint %s failed for good after %d attempt(s): %s",
                        delivery.id, delivery.event_type, delivery.video_id, endpoint.id, delivery.attempts,
                        result.error)
            if self.observer is not None:
                self.observer.on_webhook_given_up()
        else:
            log.info("webhook %s to endpoint %s: attempt %d failed (%s); next in %.1f s", delivery.id, endpoint.id,
                     delivery.attempts, result.error, retry_at - now)
