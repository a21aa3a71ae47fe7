"""Adapter bytes in the placement plan: per-request LoRA factors on the device and in host memory, per rank.

A served LoRA lives beside the DiT's weights (h3serve.rank.lora): every loaded DiT keeps one zero slot (the
"no adapter" factors), the device cache up to `max_loras` adapters at the slot rank, the host cache up to
`max_cpu_loras` adapters (counted at the slot rank: an upper bound), all cut for tensor parallelism like their
layers. A FastH3 adapter costs nothing here: it is fused into the DiT's own weights at load.
"""

from __future__ import annotations

from dataclasses import replace

from h3serve.offload.plan import PlacementPlan, RankPlan

ADAPTERS = "lora adapters"


def slot_elements(cfg, slot_rank: int, tp: int) -> int:
    """Elements of one adapter slot of one DiT on one rank (H3TransformerConfig `cfg`, TP degree `tp`)."""
    d, inner, ffn, r = cfg.hidden_size, cfg.inner_dim, cfg.ffn_dim, slot_rank
    per_block = (
        3 * r * d + 3 * (inner // tp) * r  # fused q/k/v: A [3R, D] whole, B [3, inner/tp, R] cut by rows
        + r * (inner // tp) + d * r  # out: A cut by columns, B whole
        + r * d + (2 * ffn // tp) * r  # ff in [value; gate]
        + r * (ffn // tp) + d * r  # ff out
    )
    return per_block * (cfg.num_layers + cfg.num_refiner_layers)


def lora_bytes(
    dits: dict, slot_rank: int, tp: int, element_size: int, max_loras: int, max_cpu_loras: int
) -> tuple[int, int]:
    """(device bytes, host bytes) of one rank's LoRA slots and caches (`dits`: name -> config of loaded DiTs)."""
    if not dits or slot_rank < 1:
        return 0, 0
    slots = {name: slot_elements(cfg, slot_rank, tp) * element_size for name, cfg in dits.items()}
    largest = max(slots.values())
    return sum(slots.values()) + max_loras * largest, max_cpu_loras * largest


def with_adapter_bytes(plan: PlacementPlan, device: int, host: int) -> PlacementPlan:
    """The plan with the adapters' bytes on every rank: on the device in every stage, and in host memory."""
    if not device and not host:
        return plan

    def rank(r: RankPlan) -> RankPlan:
        stages = tuple(replace(s, weights={**s.weights, ADAPTERS: device}) for s in r.stages)
        return replace(r, stages=stages, host_bytes={**r.host_bytes, ADAPTERS: host})

    return replace(plan, ranks=tuple(rank(r) for r in plan.ranks))
