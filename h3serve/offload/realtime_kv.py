"""The clean K/V cache of a real-time session in the placement plan (torch-free).

A session holds, per DiT block, the keys and values of its bounded history
(h3serve.rules.realtime_geometry.kv_rows_bound: the sink chunk's video, the two most recent chunks and the chunk being
staged) for this rank's head shard (heads / Ulysses degree), in the DiT's dtype, from its first chunk to its end: device
bytes on every stage, like the weights.
"""

from __future__ import annotations

from dataclasses import replace

from h3serve.offload.placement_plan import PlacementPlan, RankPlan
from h3serve.rules import limits
from h3serve.rules.realtime_geometry import kv_cache_bytes

REALTIME_KV = "realtime kv cache"


def realtime_kv_bytes(dit, ulysses: int, element_size: int, width: int, height: int) -> int:
    """One rank's K/V cache bytes for a session at `width` x `height` on a DiT of config `dit`."""
    ratio = limits.VAE_SPATIAL_COMPRESSION
    frame_rows = (height // ratio // 2) * (width // ratio // 2)
    heads = dit.num_attention_heads // ulysses
    return kv_cache_bytes(dit.num_layers, heads, dit.attention_head_dim, element_size, frame_rows)


def with_realtime_cache(plan: PlacementPlan, device: int) -> PlacementPlan:
    """The plan with a session's K/V cache on the device in every stage of every rank."""
    if not device:
        return plan

    def rank(r: RankPlan) -> RankPlan:
        return replace(r, stages=tuple(replace(s, weights={**s.weights, REALTIME_KV: device}) for s in r.stages))

    return replace(plan, ranks=tuple(rank(r) for r in plan.ranks))
