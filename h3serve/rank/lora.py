"""Per-request LoRA on the DiT, applied unmerged: y = W·x + s·B(A·x), switchable without a reload.

`install_lora` wraps each declared target layer (attention q/k/v/out and both feed-forward projections of every
transformer and token-refiner block) in a `LoraLinear` whose factors and scale are buffers: switching adapter
re-points the buffers at another adapter's device tensors of the same shape and fills the scale in place, so a
compiled block sees new graph inputs, never a new graph. Every adapter is zero-padded to the slot rank on the
device (exact: the padding adds zero products). A fused Q/K/V projection holds one group of factors per part.

Under tensor parallelism the factors are cut the way their layer's weight is: B's rows for a column-parallel
layer (A whole), A's columns for a row-parallel one (B whole, the partial products summed with the base's in
its one all-reduce). Weights that offload moves between host and device are not supported (refused by config).
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from h3serve.adapters.catalog import AdapterChoice, lora_file
from h3serve.adapters.peft import target_shapes
from h3serve.model.transformer import H3Transformer
from h3serve.parallel.comm import all_reduce_wide
from h3serve.parallel.tensor_parallel import RowParallelLinear, TensorParallel


class LoraLinear(nn.Module):
    """A target layer plus low-rank factors: `lora_a` [g·R, in], `lora_b` [g, out/g, R], `lora_scale` (0-dim).

    `g` groups split the output into equal parts with their own factors (3 for a fused [q | k | v] projection).
    """

    def __init__(self, base: nn.Linear, groups: int, slot_rank: int, scale: torch.Tensor):
        super().__init__()
        self.base = base
        self.groups = groups
        w = base.weight
        self.register_buffer("lora_a", w.new_zeros((groups * slot_rank, w.shape[1])), persistent=False)
        self.register_buffer("lora_b", w.new_zeros((groups, w.shape[0] // groups, slot_rank)), persistent=False)
        self.register_buffer("lora_scale", scale, persistent=False)

    @property
    def weight(self) -> torch.Tensor:
        return self.base.weight

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        h = F.linear(x, self.lora_a)
        if self.groups == 1:
            d = F.linear(h, self.lora_b[0])
        else:
            d = torch.einsum("...gr,gor->...go", h.unflatten(-1, (self.groups, -1)), self.lora_b).flatten(-2)
        return d * self.lora_scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base = self.base
        if isinstance(base, RowParallelLinear):  # the partial low-rank products ride on the base's all-reduce
            y = all_reduce_wide(F.linear(x, base.weight) + self.delta(x), base.group)  # bf16 partials summed in fp32
            return y if base.bias is None else y + base.bias
        return base(x) + self.delta(x)


def wrapped_targets(dit: H3Transformer) -> list[tuple[str, tuple[str, ...]]]:
    """(layer path, the adapter target names it holds, in output order) for every LoRA layer of `dit`."""
    blocks = [f"transformer_blocks.{i}" for i in range(len(dit.transformer_blocks))]
    blocks += [f"token_refiner.refiner_blocks.{i}" for i in range(len(dit.token_refiner.refiner_blocks))]
    layers = []
    for block in blocks:
        attn = dit.get_submodule(f"{block}.attn")
        if getattr(attn, "to_qkv", None) is not None:
            layers.append((f"{block}.attn.to_qkv", tuple(f"{block}.attn.to_{p}" for p in "qkv")))
        else:
            layers += [(f"{block}.attn.to_{p}", (f"{block}.attn.to_{p}",)) for p in "qkv"]
        layers += [(f"{block}.{t}", (f"{block}.{t}",)) for t in ("attn.to_out.0", "ff.net.0.proj", "ff.net.2")]
    return layers


def install_lora(dit: H3Transformer, slot_rank: int, scale: torch.Tensor) -> list[LoraLinear]:
    """Wrap every target layer of `dit` (after Q/K/V fusion, before compile); returns them in `wrapped_targets`
    order. The factors start at zero, `scale` is the shared 0-dim scale buffer."""
    wrappers = []
    for path, parts in wrapped_targets(dit):
        base = dit.get_submodule(path)
        if isinstance(base, LoraLinear):
            raise ValueError(f"{path} already carries a LoRA wrapper")
        wrapper = LoraLinear(base, len(parts), slot_rank, scale)
        dit.set_submodule(path, wrapper)
        wrappers.append(wrapper)
    return wrappers


@dataclass(frozen=True)
class HostFactors:
    """One adapter's factors as this rank holds them: target -> (A, B), cut for tensor parallelism."""

    rank: int
    unit_scale: float  # alpha / r
    factors: dict[str, tuple[torch.Tensor, torch.Tensor]]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.factors.values())


def read_factors(path: str, dit_config: dict, tp: TensorParallel | None = None) -> HostFactors:
    """Read a LoRA file (checked against the DiT's targets first), keeping only this rank's slices under `tp`."""
    shapes = target_shapes(dit_config)
    info = lora_file(path, shapes)
    factors = {}
    with safe_open(str(info.path), framework="pt", device="cpu") as f:
        for target, (key_a, key_b) in info.keys.items():
            ranges = None if tp is None else tp.ranges(f"{target}.weight", shapes[target])
            if ranges is None:
                a, b = f.get_tensor(key_a), f.get_tensor(key_b)
            elif ranges[0] == 0:  # column-parallel: this rank's output rows of B
                a, b = f.get_tensor(key_a), TensorParallel.read_ranges(f, key_b, ranges)
            else:  # row-parallel: this rank's input columns of A
                a, b = TensorParallel.read_ranges(f, key_a, ranges), f.get_tensor(key_b)
            factors[target] = (a, b)
    return HostFactors(info.rank, info.unit_scale, factors)


def device_factors(
    host: HostFactors,
    layers: list[tuple[str, tuple[str, ...]]],
    wrappers: list[LoraLinear],
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per wrapper, (lora_a, lora_b) shaped like its buffers: the adapter's factors zero-padded to the slot rank,
    in the wrapper's dtype and on its device; a target the adapter lacks stays zero."""
    out = []
    for (_, parts), wrapper in zip(layers, wrappers, strict=True):
        a = torch.zeros_like(wrapper.lora_a)
        b = torch.zeros_like(wrapper.lora_b)
        slot = b.shape[-1]
        if host.rank > slot:
            raise ValueError(f"adapter rank {host.rank} exceeds the LoRA slot rank {slot} (--max-lora-rank)")
        for g, target in enumerate(parts):
            if target in host.factors:
                fa, fb = host.factors[target]
                a[g * slot : g * slot + host.rank] = fa.to(a.dtype)
                b[g, :, : host.rank] = fb.to(b.dtype)
        out.append((a, b))
    return out


class LRU:
    """A bounded least-recently-used map; `get_or_make` builds a missing value and evicts the oldest."""

    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError(f"an adapter cache holds at least 1 entry, got {capacity}")
        self.capacity = capacity
        self.items: OrderedDict = OrderedDict()

    def get_or_make(self, key, make: Callable[[], object]):
        if key in self.items:
            self.items.move_to_end(key)
            return self.items[key]
        value = make()
        self.items[key] = value
        while len(self.items) > self.capacity:
            self.items.popitem(last=False)
        return value


class LoraRuntime:
    """The LoRA wrappers of the loaded DiTs and the adapters cached in host memory and on the device."""

    def __init__(
        self,
        dits: dict[str, H3Transformer],
        slot_rank: int,
        max_cpu_loras: int = 4,
        max_loras: int = 2,
        tp: TensorParallel | None = None,
    ):
        self.tp = tp
        self.host = LRU(max_cpu_loras)
        self.device = LRU(max_loras)
        self.slot_rank = slot_rank
        self.dits: dict[str, tuple[H3Transformer, list, list[LoraLinear], torch.Tensor, list]] = {}
        for name, dit in dits.items():
            scale = torch.zeros((), dtype=torch.float32, device=next(dit.parameters()).device)
            layers = wrapped_targets(dit)
            wrappers = install_lora(dit, slot_rank, scale)
            null = [(w.lora_a, w.lora_b) for w in wrappers]
            self.dits[name] = (dit, layers, wrappers, scale, null)
        self.active: dict[str, str | None] = dict.fromkeys(dits)

    def activate(self, dit_name: str, choice: AdapterChoice | None) -> None:
        """Point `dit_name`'s wrappers at `choice`'s factors with its scale (None: zero factors, scale 0)."""
        dit, layers, wrappers, scale, null = self.dits[dit_name]
        if choice is None:
            tensors, value = null, 0.0
        else:
            cfg = dataclasses.asdict(dit.config)
            host: HostFactors = self.host.get_or_make(
                choice.path, lambda: read_factors(choice.path, cfg, self.tp)
            )
            tensors = self.device.get_or_make(
                (dit_name, choice.path), lambda: device_factors(host, layers, wrappers)
            )
            value = choice.scale * host.unit_scale
        for wrapper, (a, b) in zip(wrappers, tensors, strict=True):
            wrapper.lora_a, wrapper.lora_b = a, b
        scale.fill_(value)
        self.active[dit_name] = None if choice is None else choice.name

    def host_bytes(self) -> int:
        return sum(h.nbytes for h in self.host.items.values())

    def device_bytes(self) -> int:
        return sum(a.nbytes + b.nbytes for tensors in self.device.items.values() for a, b in tensors)


def dit_for(plan) -> str:
    """The DiT a plan runs on: Ref2VA and windowed continuation use the reference DiT."""
    return "transformer_ref" if plan.task == "ref2va" or plan.continuation else "transformer"


class EngineLora(LoraRuntime):
    """The engine's runtime: activates a plan's adapter on the DiT the plan uses, zero on the others."""

    def activate_for(self, plan) -> None:
        used = dit_for(plan)
        for name in self.dits:
            self.activate(name, plan.lora if name == used else None)


def lora_runtime(config, components, tp: TensorParallel | None) -> EngineLora | None:
    """Wrap the loaded DiTs' target layers when the engine serves LoRA (--lora-path / --lora-dir), else None."""
    from h3serve.adapters.serving import catalog_for

    catalog = catalog_for(config, log=lambda text: None)
    if catalog is None:
        return None
    dits = {name: dit for name in ("transformer", "transformer_ref") if (dit := getattr(components, name)) is not None}
    return EngineLora(dits, catalog.slot_rank, config.max_cpu_loras, config.max_loras, tp)
