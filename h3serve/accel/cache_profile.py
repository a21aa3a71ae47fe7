"""The DiT caches' parameters (`--cache-config`, a request's `quality`): plain data, no torch, so the engine flags
are checked in the API process. `CacheProfile`: Cache-DiT's DBCache (`h3serve.accel.cache` runs it through
cache-dit); `TeaCacheProfile`: TeaCache (`h3serve.accel.teacache`)."""

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

# vLLM-Omni's TeaCache calibration for the FL2VA DiT (#5840, `teacache/config.py`): numpy.poly1d coefficients,
# highest power first, fitted on 70 T2VA prompts (256x448, 107 frames, 50 steps, 3,360 forced pairs; R^2 0.095).
TEACACHE_COEFFICIENTS = (2283.7040658527776, -777.5977277886368, 94.0841474135949, -4.232669906169421,
                         0.2173782527946167)
TEACACHE_THRESHOLD = 0.17  # the recipe's model default


@dataclass(frozen=True)
class TeaCacheProfile:
    """TeaCache's parameters, named as in vLLM-Omni's `--cache-config` for `--cache-backend tea_cache`.

    A step reuses the last computed step's block residual while the accumulated rescaled change of block 0's
    modulated input stays under `rel_l1_thresh`; `coefficients` rescale the raw relative L1 change (poly1d)."""

    rel_l1_thresh: float = TEACACHE_THRESHOLD
    coefficients: tuple[float, ...] = TEACACHE_COEFFICIENTS

    @classmethod
    def from_json(cls, data: dict) -> TeaCacheProfile:
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(data) - set(known))
        if unknown:
            raise CacheConfigError(f"--cache-config: unknown keys {', '.join(unknown)} for --cache-backend tea_cache; "
                                   f"choose from: {', '.join(known)}")
        thresh = data.get("rel_l1_thresh", TEACACHE_THRESHOLD)
        if isinstance(thresh, bool) or not isinstance(thresh, int | float) or not 0 <= thresh < float("inf"):
            raise CacheConfigError(f"--cache-config: rel_l1_thresh must be a finite number >= 0, got {thresh!r}")
        coefficients = data.get("coefficients", TEACACHE_COEFFICIENTS)
        if not isinstance(coefficients, list | tuple) or not coefficients or not all(
            isinstance(c, int | float) and not isinstance(c, bool) and abs(c) < float("inf") for c in coefficients
        ):
            raise CacheConfigError("--cache-config: coefficients must be a non-empty list of finite numbers "
                                   "(numpy.poly1d order, highest power first)")
        return cls(float(thresh), tuple(float(c) for c in coefficients))

    def rescale(self, change: float) -> float:
        """poly(change), Horner's rule (numpy.poly1d's order: highest power first)."""
        value = 0.0
        for c in self.coefficients:
            value = value * change + c
        return value


ServerCache = CacheProfile | TeaCacheProfile


def profile_for(quality: str | None, server: ServerCache | None) -> ServerCache | None:
    """The cache a request runs with: omitted -> the server's (None without --cache-backend); `lossless` -> none;
    `high` -> Cache-DiT's built-in high-quality profile, with or without a server cache (on a TeaCache server
    too: `high` names that profile everywhere)."""
    if quality is None:
        return server
    return None if quality == "lossless" else HIGH
