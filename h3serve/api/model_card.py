"""The served model's capabilities on its `GET /v1/models` card: what the engine was started with, as a client
needs it to form requests (the DiT caches and their per-request controls, the attention core, a distilled
checkpoint's pinned schedule, the adapter formats recognised, timeline guides). Torch-free: the engine flags and the
defaults the ranks reported, nothing loaded."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from h3serve.accel.cache_profile import HIGH, CacheProfile, TeaCacheProfile, server_cache_profile
from h3serve.checkpoint.resolver import CheckpointError, read_layout
from h3serve.config.engine_config import EngineConfig
from h3serve.rules.defaults import ModelDefaults
from h3serve.rules.guides import guide_capability
from h3serve.rules.names import QUALITIES, REFRESH_POLICIES
from h3serve.rules.validate.resolve import TEA_CACHE_TASKS

# Adapter layouts a request's `lora` (or --lora-path) is recognised as (h3serve.adapters), all applied unmerged.
ADAPTER_FORMATS = ("peft", "turbo", "pdd", "flashgen")
VSA_TILE_ROWS = 64  # h3serve.accel.video_sparse.TILE_ROWS (that module imports torch)
VSA_DEFAULT_SPARSITY = 0.8


def _cache(engine: EngineConfig) -> dict[str, Any]:
    """The DiT caches: the server's (`quality` omitted), Cache-DiT's `high`, and the forced refresh's fields."""
    profile = server_cache_profile(engine)
    server: dict[str, Any] = {"backend": engine.cache_backend}
    if isinstance(profile, TeaCacheProfile):
        server |= {"rel_l1_thresh": profile.rel_l1_thresh, "coefficients": list(profile.coefficients),
                   "tasks": list(TEA_CACHE_TASKS), "signal": "block 0 modulated input"}
    elif isinstance(profile, CacheProfile):
        server |= asdict(profile)
    return {
        "server": server,
        "quality": {"values": list(QUALITIES), "omitted": engine.cache_backend, "lossless": "none",
                    "high": {"backend": "cache_dit", **asdict(HIGH)}},
        "force_refresh": {"fields": ["extra_params.force_refresh_step_hint", "extra_params.force_refresh_step_policy"],
                          "policies": list(REFRESH_POLICIES)},
    }


def _attention(engine: EngineConfig, sparsity: float | None) -> dict[str, Any]:
    roles = dict(engine.attention_per_role)
    card: dict[str, Any] = {"backend": roles.get("self", engine.attention_backend)}
    if engine.sparse_attention:
        keep: dict[str, Any] = ({"topk": engine.vsa_topk} if engine.vsa_topk is not None
                                else {"sparsity": VSA_DEFAULT_SPARSITY if sparsity is None else sparsity})
        card["video_sparse_attention"] = {"tile_rows": VSA_TILE_ROWS, "video_tile": [4, 4, 4], **keep}
    return card


def _schedule(defaults: ModelDefaults) -> dict[str, Any] | None:
    pin = defaults.pinned_schedule
    if pin is None:
        return None
    return {"owner": pin.owner, "forwards": pin.forwards,
            "positions": None if pin.positions is None else list(pin.positions),
            "flow_shift": defaults.flow_shift, "audio_flow_shift": defaults.audio_flow_shift}


def capabilities(engine: EngineConfig | None, defaults: ModelDefaults, tasks: tuple[str, ...]) -> dict[str, Any]:
    """The card's `capabilities` object (`engine` None: a server without engine flags to show, e.g. in tests)."""
    card: dict[str, Any] = {"tasks": list(tasks), "adapters": {"formats": list(ADAPTER_FORMATS),
                                                                "applied": "unmerged"}}
    schedule = _schedule(defaults)
    if schedule is not None:
        card["pinned_schedule"] = schedule
    if defaults.distilled_checkpoint is not None:
        card["checkpoint"] = {"name": defaults.distilled_checkpoint, "lora": False}
    card["timeline_guides"] = guide_capability(defaults)
    if engine is None:
        return card
    sparsity = None
    if engine.sparse_attention:
        try:
            contract = read_layout(engine.model, engine.dits, base=engine.base_checkpoint).contract
        except CheckpointError:
            contract = None  # the engine started with this layout; a card never fails on a moved file
        sparsity = None if contract is None else contract.sparsity
    card["cache"] = _cache(engine)
    card["attention"] = _attention(engine, sparsity)
    return card
