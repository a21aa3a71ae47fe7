"""The DiT caches' parameters (`--cache-config`, a request's `quality`): plain data, no torch, so the engine flags
are checked in the API process. `CacheProfile`: Cache-DiT's DBCache (`h3serve.accel.cache` runs it through
cache-dit); `TeaCacheProfile`: TeaCache (`h3serve.accel.teacache`)."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields

from h3serve.config.engine_config import EngineConfig
from h3serve.errors import ConfigError, ServerError


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


def server_cache_profile(config: EngineConfig) -> ServerCache | None:
    """The server's cache: a Cache-DiT `CacheProfile` (--cache-backend cache_dit), a `TeaCacheProfile` (tea_cache)
    over --cache-config, or None without --cache-backend. `ConfigError` on a bad --cache-config."""
    if config.cache_backend == "none":
        return None
    try:
        data = json.loads(config.cache_config or "{}")
        if not isinstance(data, dict):
            raise CacheConfigError(f"--cache-config: expected a JSON object, got {type(data).__name__}")
        if config.cache_backend == "tea_cache":
            return TeaCacheProfile.from_json(data)
        return CacheProfile.from_json(data)
    except (CacheConfigError, TypeError, json.JSONDecodeError) as e:
        raise ConfigError(str(e)) from None


def backend_refusal(config: EngineConfig, device_type: str | None = None) -> str | None:
    """Why this engine cannot run its --cache-backend (None: it can, or there is none)."""
    if config.cache_backend == "tea_cache":  # sequence parallelism is fine: the ranks MAX-reduce each decision
        return _block_loop_refusal(config)
    if config.cache_backend == "cache_dit":
        return cache_refusal(config, device_type)
    return None


def _block_loop_refusal(config: EngineConfig) -> str | None:
    """Why a cache that skips DiT blocks cannot run here: layerwise offload streams every block in order, and a
    whole-forward graph has no block loop to swap."""
    if config.offload.streamed:
        return "layerwise offload (skipped blocks would break the streaming order); use module offload or none"
    if config.full_graph:
        return "diffusion_compile_granularity='full' (the cache swaps the block loop); use 'regional'"
    return None


def cache_refusal(config: EngineConfig, device_type: str | None = None) -> str | None:
    """Why this engine cannot run Cache-DiT's block cache (--cache-backend cache_dit, or a `quality=high` request);
    None when it can. `device_type` defaults to --device's (None for `auto`: the reasons that need no device)."""
    device_type = device_type or config.device_type
    if config.ulysses_degree * config.ring_degree > 1:
        return "sequence parallelism (each rank would judge the residual on its own rows); drop --usp/--ring"
    if refusal := _block_loop_refusal(config):
        return refusal
    if config.world_size > 1 and device_type == "cpu":
        return ("several CPU ranks (cache-dit averages the residual over the ranks with an AVG all-reduce, which "
                "gloo lacks)")
    return None
