"""First-block residual caching of the DiT's block loop (Cache-DiT's DBCache policy, implemented here).

Each denoise step runs the first Fn blocks, then compares their residual (output - input) with the one of the
last fully computed step. When the relative L1 change is under the threshold (after the warm-up steps, and for
at most N steps in a row), the middle blocks are skipped: their residual from the last computed step is added
instead. The last Bn blocks always run, and so does everything after the block loop (the output norm and both
the video and the audio heads), so a cached step never skips the audio rows' head.

Why not the cache-dit library itself: see docs/benchmarks.md (Cache-DiT); the policy and its parameter names are
cache-dit's, so `--cache-config` JSON written for cache-dit's DBCache applies unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

import torch
from torch import nn


class CacheConfigError(ValueError):
    """An unknown key or an illegal value in --cache-config."""


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


class BlockCache:
    """One request's cache state (one DiT, its denoise steps in order). Counts block evaluations."""

    def __init__(self, profile: CacheProfile):
        self.profile = profile
        self.step = 0
        self.consecutive = 0
        self.first_residual: torch.Tensor | None = None  # of the last fully computed step
        self.middle_residual: torch.Tensor | None = None
        self.evaluated = 0
        self.skipped = 0
        self.cached_steps = 0

    def _can_skip(self, first_residual: torch.Tensor) -> bool:
        p = self.profile
        if self.step < p.max_warmup_steps or self.middle_residual is None or self.first_residual is None:
            return False
        if 0 <= p.max_continuous_cached_steps <= self.consecutive:
            return False
        prev = self.first_residual
        change = (first_residual - prev).abs().mean() / prev.abs().mean().clamp_min(1e-12)
        return change.item() < p.residual_diff_threshold

    def run(self, blocks: Sequence[nn.Module], x: torch.Tensor, *args: object) -> torch.Tensor:
        """The block loop of one forward: `x = block(x, *args)` for each block, or the cached shortcut."""
        n, fn, bn = len(blocks), self.profile.Fn_compute_blocks, self.profile.Bn_compute_blocks
        fn = min(fn, n)
        middle = range(fn, max(fn, n - bn))
        x_in = x
        for block in blocks[:fn]:
            x = block(x, *args)
        first_residual = x - x_in
        if self._can_skip(first_residual):
            x = x + self.middle_residual
            self.consecutive += 1
            self.cached_steps += 1
            self.skipped += len(middle)
        else:
            x_mid = x
            for i in middle:
                x = blocks[i](x, *args)
            self.middle_residual = x - x_mid
            self.first_residual = first_residual
            self.consecutive = 0
            self.evaluated += len(middle)
        for block in blocks[middle.stop :]:
            x = block(x, *args)
        self.evaluated += fn + (n - middle.stop)
        self.step += 1
        return x
