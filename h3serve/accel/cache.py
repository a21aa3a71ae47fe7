"""Cache-DiT's DBCache on the DiT's block loop, through the cache-dit library (its `BlockAdapter`).

Each denoise step runs the first Fn blocks, and cache-dit compares their residual (output - input) with the one
of the last fully computed step. When the relative L1 change is under the threshold (after the warm-up steps, and
for at most N steps in a row), the middle blocks are skipped and their residual from the last computed step is
added instead. The last Bn blocks always run, and so does everything after the block loop in
`H3Transformer.forward` (the output norm and both the video and the audio heads): a cached step never skips the
audio rows' head.

The cache is installed per request (`block_cache`) and removed after it, so a `quality=lossless` request runs the
plain loop. The profile's fields are cache-dit's `DBCacheConfig` names, so `--cache-config` JSON written for
cache-dit applies unchanged.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import asdict

from torch import nn

from h3serve.accel.cache_profile import HIGH, CacheConfigError, CacheProfile, profile_for
from h3serve.extras import require
from h3serve.model.pipeline_types import CacheStats

__all__ = ["HIGH", "CacheConfigError", "CacheProfile", "CacheStats", "DitBlockCache", "block_cache", "profile_for"]


def _cache_dit():
    """cache-dit, imported on first use (it imports diffusers eagerly; a few seconds) and quiet unless asked."""
    os.environ.setdefault("CACHE_DIT_LOG_LEVEL", "error")
    require("cache", "the DiT block cache")
    import cache_dit

    return cache_dit


@contextmanager
def block_cache(transformer: nn.Module, profile: CacheProfile, forwards: int) -> Iterator[CacheStats]:
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
    config = cache_dit.DBCacheConfig(num_inference_steps=forwards, **asdict(profile))
    calls = {"blocks": 0, "forwards": 0}

    def counter(key: str):
        def count(*_) -> None:
            calls[key] += 1

        return count

    hooks = [block.register_forward_pre_hook(counter("blocks")) for block in blocks]
    hooks.append(transformer.register_forward_pre_hook(counter("forwards")))
    cache_dit.enable_cache(adapter, cache_config=config)
    stats = CacheStats()
    try:
        yield stats
    finally:
        manager = transformer._context_manager  # set by enable_cache; one context for our one block list
        cached = {step for name in transformer._context_names for step in manager.get_context(name).cached_steps}
        cache_dit.disable_cache(adapter)
        for hook in hooks:
            hook.remove()
        stats.evaluated, stats.cached_steps = calls["blocks"], len(cached)
        stats.skipped = calls["forwards"] * len(blocks) - calls["blocks"]


class DitBlockCache:
    """The pipeline's `BlockCache` (h3serve.model.pipeline_types): cache-dit's DBCache with the server's profile
    (`--cache-backend cache_dit`; None: off), or the built-in `high` one for a `quality=high` request."""

    def __init__(self, server: CacheProfile | None):
        self.server = server

    def active(self, quality: str | None) -> bool:
        return profile_for(quality, self.server) is not None

    def for_request(
        self, dit: nn.Module, quality: str | None, forwards: int
    ) -> AbstractContextManager[CacheStats | None]:
        profile = profile_for(quality, self.server)
        return nullcontext() if profile is None else block_cache(dit, profile, forwards)
