"""A request's forced DiT-cache refresh: vLLM-Omni's `extra_params.force_refresh_step_hint` (a strict int in
1..num_inference_steps) and `force_refresh_step_policy` (`once`, the default, or `repeat`). Torch-free.

Meaning (Cache-DiT's, which vLLM-Omni forwards; TeaCache here the same): once `hint` forwards have run, the cache
starts afresh as if a new generation began (Cache-DiT: its context resets, so its warm-up steps compute every
block again; TeaCache: that forward is computed and its accumulator restarts). `repeat` does so after every `hint`
forwards. Either argument without a DiT cache active for the request is a client error, as in vLLM-Omni.
"""

from __future__ import annotations

from dataclasses import dataclass

from h3serve.errors import RequestError
from h3serve.rules.names import REFRESH_POLICIES

HINT_FIELD = "extra_params.force_refresh_step_hint"
POLICY_FIELD = "extra_params.force_refresh_step_policy"


@dataclass(frozen=True)
class ForceRefresh:
    """When a request's DiT cache starts afresh: after `hint` forwards (`once`), or after every `hint` (`repeat`)."""

    hint: int
    policy: str = "once"

    def refreshes(self, forward: int) -> bool:
        """Whether the cache starts afresh before forward `forward` (0-based; forward 0 always starts fresh)."""
        if forward <= 0:
            return False
        return forward == self.hint or (self.policy == "repeat" and forward % self.hint == 0)


def resolve_force_refresh(
    hint: object, policy: object, steps: int, cache: str | None
) -> ForceRefresh | None:
    """The request's refresh, checked: `hint` a strict int in 1..steps, `policy` once | repeat and only beside a
    hint, and both only when `cache` (the DiT cache the request runs under, None for none) is active."""
    if hint is None and policy is None:
        return None
    if hint is None:
        raise RequestError(POLICY_FIELD, "needs force_refresh_step_hint (the forward count after which the cache "
                                         "starts afresh)")
    if isinstance(hint, bool) or not isinstance(hint, int):
        raise RequestError(HINT_FIELD, f"must be an integer, got {hint!r}")
    if not 1 <= hint <= steps:
        raise RequestError(HINT_FIELD, f"must be between 1 and num_inference_steps ({steps}), got {hint}")
    if policy is not None and policy not in REFRESH_POLICIES:
        raise RequestError(POLICY_FIELD, f"must be one of {', '.join(REFRESH_POLICIES)}, got {policy!r}")
    if cache is None:
        raise RequestError(
            HINT_FIELD,
            "needs a DiT cache active for the request: quality=high (Cache-DiT), or quality omitted on a server "
            "started with --cache-backend cache_dit or tea_cache (TeaCache: T2VA and FL2VA requests)",
        )
    return ForceRefresh(hint, "once" if policy is None else str(policy))
