"""The DiT block cache's parameters (`--cache-config`, a request's `quality`): plain data, no torch, so the engine
flags are checked in the API process; `h3serve.accel.cache` runs them through cache-dit."""

from __future__ import annotations

from dataclasses import dataclass, fields

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
