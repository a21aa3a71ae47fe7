"""Adapter bytes in the placement plan: per-request LoRA factors on the device and in host memory, per rank.

A served LoRA lives beside the DiT's weights (h3serve.rank.lora). Every block of a loaded DiT holds one zero slot
of factors at the slot rank (the "no adapter" factors, and an offloaded DiT's current adapter): they count in the
block's bytes (`with_lora_blocks`), so they are placed, staged and streamed with it. A resident DiT also has the
device cache of up to `max_loras` adapters; the host cache holds up to `max_cpu_loras` (counted at the slot rank:
an upper bound). All of it is cut for tensor parallelism like the layers, in the compute dtype. A FastH3 adapter
costs nothing here: it is fused into the DiT's own weights at load.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from h3serve.offload.placement_plan import PlacementPlan, RankPlan

if TYPE_CHECKING:  # the inventory needs torch; the report (parent side) reads ADAPTERS from here
    from h3serve.offload.inventory import Inventory

ADAPTERS = "lora adapters"


def block_elements(cfg, slot_rank: int, tp: int, adaln: bool = False) -> int:
    """Elements of one block's LoRA factors on one rank (H3TransformerConfig `cfg`, TP degree `tp`); a token
    refiner block has the same widths. `adaln`: the AdaLN projection's factors too (a PDD adapter's target; counted
    on every block, an upper bound for the refiner's, which have none)."""
    d, inner, ffn, r = cfg.hidden_size, cfg.inner_dim, cfg.ffn_dim, slot_rank
    adaln_elements = r * cfg.time_embed_dim + (18 * d // tp) * r if adaln else 0  # A whole, B cut by rows
    return adaln_elements + (
        3 * r * d
        + 3 * (inner // tp) * r  # fused q/k/v: A [3R, D] whole, B [3, inner/tp, R] cut by rows
        + r * (inner // tp)
        + d * r  # out: A cut by columns, B whole
        + r * d
        + (2 * ffn // tp) * r  # ff in [value; gate]
        + r * (ffn // tp)
        + d * r  # ff out
    )


def slot_elements(cfg, slot_rank: int, tp: int, adaln: bool = False) -> int:
    """Elements of one adapter slot of one DiT on one rank: every block's factors."""
    return block_elements(cfg, slot_rank, tp, adaln) * (cfg.num_layers + cfg.num_refiner_layers)


def lora_bytes(
    dits: dict,
    slot_rank: int,
    tp: int,
    element_size: int,
    max_loras: int,
    max_cpu_loras: int,
    offloaded: frozenset[str] = frozenset(),
    adaln: bool = False,
) -> tuple[int, int]:
    """(device bytes, host bytes) of one rank's LoRA caches (`dits`: name -> config of the loaded DiTs; those in
    `offloaded` take their adapter into their blocks and use no device cache). The blocks' own slots are not in
    these figures: `with_lora_blocks` adds them to the DiTs."""
    if not dits or slot_rank < 1:
        return 0, 0
    slots = {name: slot_elements(cfg, slot_rank, tp, adaln) * element_size for name, cfg in dits.items()}
    resident = [slots[name] for name in slots if name not in offloaded]
    return max_loras * max(resident, default=0), max_cpu_loras * max(slots.values())


def with_lora_blocks(inv: Inventory, slot_rank: int, adaln: bool = False) -> Inventory:
    """The inventory with every block of each DiT carrying its zero slot of LoRA factors (`slot_rank` 0: none;
    `adaln`: the AdaLN projections' too)."""
    if slot_rank < 1:
        return inv
    tp = inv.degrees.tensor_parallel

    def grown(name: str, c):
        if name not in inv.dits:
            return c
        extra = block_elements(inv.dits[name], slot_rank, tp, adaln) * inv.element_size
        groups = tuple(replace(g, block_bytes=tuple(b + extra for b in g.block_bytes)) for g in c.groups)
        return replace(c, groups=groups)

    ranks = tuple({name: grown(name, c) for name, c in held.items()} for held in inv.ranks)
    return replace(inv, ranks=ranks)


def with_adapter_bytes(plan: PlacementPlan, device: int, host: int) -> PlacementPlan:
    """The plan with the adapters' bytes on every rank: on the device in every stage, and in host memory."""
    if not device and not host:
        return plan

    def rank(r: RankPlan) -> RankPlan:
        stages = tuple(replace(s, weights={**s.weights, ADAPTERS: device} if device else s.weights) for s in r.stages)
        return replace(r, stages=stages, host_bytes={**r.host_bytes, ADAPTERS: host})

    return replace(plan, ranks=tuple(rank(r) for r in plan.ranks))
