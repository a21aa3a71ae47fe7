"""Cache-DiT's DBCache on the DiT's block loop, through the cache-dit library (its `BlockAdapter`).

Each denoise step runs the first Fn blocks, and cache-dit compares their residual (output - input) with the one
of the last fully computed step. When the relative L1 change is under the threshold (after the warm-up steps, and
for at most N steps in a row), the middle blocks are skipped and their residual from the last computed step is
added instead. The last Bn blocks always run, and so does everything after the block loop in
`H3Transformer.forward` (the output norm and both the video and the audio heads): a cached step never skips the
audio rows' head.

The cache is installed per request (`block_cache`) and removed after it, so a `quality=lossless` request runs the
plain loop. The profile's fields are cache-dit's `DBCacheConfig` names, so `--cache-config` JSON written for
cache-dit applies unchanged. A request's forced refresh (`extra_params.force_refresh_step_hint` / `_policy`) is
cache-dit's own `force_refresh_step_hint` / `force_refresh_step_policy`.

`DitBlockCache` is what the pipeline holds: the server's cache (Cache-DiT or TeaCache, h3serve.accel.teacache)
for requests that omit `quality`, Cache-DiT's `high` profile for `quality=high`, none for `lossless`.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import asdict

from torch import nn
from torch.distributed import ProcessGroup

from h3serve.accel.cache_profile import HIGH, CacheConfigError, CacheProfile, ServerCache, TeaCacheProfile, profile_for
from h3serve.accel.teacache import tea_cache
from h3serve.extras import require
from h3serve.model.pipeline_types import CacheStats
from h3serve.rules.cache_refresh import ForceRefresh

__all__ = ["HIGH", "CacheConfigError", "CacheProfile", "CacheStats", "DitBlockCache", "block_cache", "profile_for"]


def _cache_dit():
    """cache-dit, imported on first use (it imports diffusers eagerly; a few seconds) and quiet unless asked."""
    os.environ.setdefault("CACHE_DIT_LOG_LEVEL", "error")
    require("cache", "the DiT block cache")
    import cache_dit

    return cache_dit


@contextmanager
def block_cache(
    transformer: nn.Module, profile: CacheProfile, forwards: int, refresh: ForceRefresh | None = None
) -> Iterator[CacheStats]:
    """Install cache-dit's DBCache on `transformer.transformer_blocks` for one request of `forwards` DiT calls.

    The transformer must call its blocks as `x = block(x, *args)` (cache-dit's forward pattern 3). The stats are
    filled in when the block ends; the transformer is back to its plain forward afterwards, even on error."""
    cache_dit = _cache_dit()
    blocks = transformer.transformer_blocks
    adapter = cache_dit.BlockAdapter(
        transformer=transformer,
        blocks=blocks,
        forward_pattern=cache_dit.ForwardPattern.Pattern_3,
        check_forward_pattern=False,
    )
    forced = {} if refresh is None else {"force_refresh_step_hint": refresh.hint,
                                         "force_refresh_step_policy": refresh.policy}
    config = cache_dit.DBCacheConfig(num_inference_steps=forwards, **asdict(profile), **forced)
    calls = {"forwards": 0}
    block_calls = [0] * len(blocks)

    def count_forward(*_) -> None:
        calls["forwards"] += 1

    def count_block(index: int):
        def count(*_) -> None:
            block_calls[index] += 1

        return count

    hooks = [block.register_forward_pre_hook(count_block(i)) for i, block in enumerate(blocks)]
    hooks.append(transformer.register_forward_pre_hook(count_forward))
    cache_dit.enable_cache(adapter, cache_config=config)
    stats = CacheStats()
    try:
        yield stats
    finally:
        cache_dit.disable_cache(adapter)
        for hook in hooks:
            hook.remove()
        # A cached step skips the first middle block (index Fn); counted here rather than from cache-dit's step
        # sets, whose indices restart after a forced refresh.
        first_middle = profile.Fn_compute_blocks
        has_middle = first_middle < len(blocks) - profile.Bn_compute_blocks
        middle_calls = block_calls[first_middle] if has_middle else calls["forwards"]
        stats.evaluated, stats.cached_steps = sum(block_calls), calls["forwards"] - middle_calls
        stats.skipped = calls["forwards"] * len(blocks) - sum(block_calls)


class DitBlockCache:
    """The pipeline's `BlockCache` (h3serve.model.pipeline_types): the server's cache (`--cache-backend cache_dit`:
    cache-dit's DBCache with the server's profile; `tea_cache`: TeaCache, on the FL2VA DiT `tea_dit` only; None:
    off), or Cache-DiT's built-in `high` profile for a `quality=high` request. `group`: the sequence-parallel group
    whose ranks agree on each TeaCache decision."""

    def __init__(
        self, server: ServerCache | None, tea_dit: nn.Module | None = None, group: ProcessGroup | None = None
    ):
        self.server = server
        self.tea_dit = tea_dit
        self.group = group

    def active(self, quality: str | None) -> bool:
        return profile_for(quality, self.server) is not None

    def for_request(
        self, dit: nn.Module, quality: str | None, forwards: int, refresh: ForceRefresh | None = None
    ) -> AbstractContextManager[CacheStats | None]:
        profile = profile_for(quality, self.server)
        if profile is None:
            return nullcontext()
        if isinstance(profile, TeaCacheProfile):  # calibrated for the FL2VA DiT: a Ref2VA request runs uncached
            return nullcontext() if dit is not self.tea_dit else tea_cache(dit, profile, refresh, self.group)
        return block_cache(dit, profile, forwards, refresh)
