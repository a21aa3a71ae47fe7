"""When a failed webhook delivery is tried again (h3serve/engine/outbox/retry.py): doubling delays with jitter,
capped, and none past the horizon."""

from __future__ import annotations

import random

from h3serve.engine.outbox.retry import RetryPolicy

SEED = 56


def test_delays_double_with_jitter_up_to_the_cap():
    policy = RetryPolicy(initial_s=2.0, max_s=60.0, horizon_s=10_000.0)
    rng = random.Random(SEED)
    for attempts in range(1, 40):
        base = min(60.0, 2.0 * 2 ** (attempts - 1))
        delays = [policy.delay_s(attempts, rng) for _ in range(50)]
        assert all(base / 2 <= d <= base for d in delays)
        assert max(delays) - min(delays) > base / 10  # jittered: receivers that failed together spread out
    assert policy.delay_s(10**6, rng) <= 60.0  # no overflow however many attempts


def test_no_attempt_is_scheduled_past_the_horizon():
    policy = RetryPolicy(initial_s=10.0, max_s=3600.0, horizon_s=100.0)
    rng = random.Random(SEED)
    assert policy.next_attempt_at(created_at=1000, attempts=1, now=1000, rng=rng) <= 1010
    assert policy.next_attempt_at(created_at=1000, attempts=4, now=1080, rng=rng) is None  # 40-80 s after 1080
    at = [policy.next_attempt_at(1000, 3, 1070, rng) for _ in range(200)]  # 20-40 s after 1070: either side
    assert {a is None for a in at} == {True, False} and all(a is None or a <= 1100 for a in at)
