"""When a failed delivery is tried again: exponential backoff with jitter, within a horizon from its event."""

from __future__ import annotations

import random
from dataclasses import dataclass

from h3serve.rules import limits

_MAX_DOUBLINGS = 62  # past this the delay is long since capped


@dataclass(frozen=True)
class RetryPolicy:
    """Attempt n + 1 waits `initial_s * 2 ** (n - 1)` after attempt n, at most `max_s`, with equal jitter (half of it
    fixed, half uniformly random, so receivers that failed together are not all retried at once). An attempt that
    would come later than `horizon_s` after the event is not made: the delivery has failed."""

    initial_s: float = limits.WEBHOOK_RETRY_INITIAL_S
    max_s: float = limits.WEBHOOK_RETRY_MAX_S
    horizon_s: float = limits.WEBHOOK_RETRY_HORIZON_S

    def delay_s(self, attempts: int, rng: random.Random) -> float:
        """The wait after the `attempts`-th attempt failed (attempts >= 1)."""
        base = min(self.max_s, self.initial_s * (1 << min(max(attempts - 1, 0), _MAX_DOUBLINGS)))
        return base / 2 + rng.uniform(0, base / 2)

    def next_attempt_at(self, created_at: float, attempts: int, now: float, rng: random.Random) -> float | None:
        """When to try again after the `attempts`-th attempt failed at `now`; None: past the horizon, give up."""
        at = now + self.delay_s(attempts, rng)
        return at if at <= created_at + self.horizon_s else None
