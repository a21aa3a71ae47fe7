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
from contextlib import contextmanager
from dataclasses import asdict, dataclass, fields

from torch import nn

from h3serve.errors import ServerError


class CacheConfigError(ServerError, ValueError):
    """An unknown key or an illegal value in --cache-config."""

    code = "invalid_config"


@dataclass(frozen=True)
class CacheProfile:
    """DBCache parameters, named as in cache-dit. The defaults are the model card's `high` profile."""

    Fn_compute_blocks: int = 1  # noqa: N815 (cache-dit's names, so its JSON applies as is)
    Bn_compute_blocks: int = 0  # noqa: N815
    max_warmup_steps: int = 4  # the first steps always compute every block
    residual_diff_threshold: float = 0.04
    max_continuous_cached_steps: int = 1  # < 0: no limit

    @classmethod
    def from_json(cls, data: dict) -> CacheProfile:
        known = {f.name: f.type for f in fields(cls)}
        unknown = sorted(set(data) - set(known))
        if unknown:
            choices = ", ".join(known)
            raise CacheConfigError(f"--cache-config: unknown keys {', '.join(unknown)}; choose from: {choices}")
        profile = cls(**data)
        for name in ("Fn_compute_blocks", "Bn_compute_blocks", "max_warmup_steps", "max_continuous_cached_steps"):
            value = getattr(profile, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise CacheConfigError(f"--cache-config: {name} must be an integer, got {value!r}")
        if profile.Fn_compute_blocks < 1 or profile.Bn_compute_blocks < 0 or profile.max_warmup_steps < 0:
            raise CacheConfigError(
                "--cache-config: needs Fn_compute_blocks >= 1, Bn_compute_blocks >= 0 and max_warmup_steps >= 0"
            )
        if not isinstance(profile.residual_diff_threshold, int | float) or profile.residual_diff_threshold < 0:
            raise CacheConfigError("--cache-config: residual_diff_threshold must be a number >= 0")
        return profile


HIGH = CacheProfile()


def profile_for(quality: str | None, server: CacheProfile | None) -> CacheProfile | None:
    """The cache a request runs with: omitted -> the server's (None without --cache-backend cache_dit);
    `lossless` -> none; `high` -> the built-in high-quality profile, with or without a server cache."""
    if quality is None:
        return server
    return None if quality == "lossless" else HIGH


@dataclass
class CacheStats:
    """One request's cache outcome: DiT block evaluations that ran (counted by hooks) and that were skipped."""

    evaluated: int = 0
    skipped: int = 0
    cached_steps: int = 0


def _cache_dit():
    """cache-dit, imported on first use (it imports diffusers eagerly; a few seconds) and quiet unless asked."""
    os.environ.setdefault("CACHE_DIT_LOG_LEVEL", "error")
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
