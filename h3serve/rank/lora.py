"""Per-request LoRA on the DiT, applied unmerged: y = W·x + s·B(A·x), switchable without a reload.

`install_lora` wraps each declared target layer (attention q/k/v/out and both feed-forward projections of every
transformer and token-refiner block) in a `LoraLinear` whose factors are buffers and whose scale is one 0-dim
buffer shared by the DiT's layers (`LoraScale`, filled in place), so a compiled block sees new graph inputs,
never a new graph. Every adapter is zero-padded to the slot rank (exact: the padding adds zero products), in the
compute dtype (an FP8 base layer keeps its factors in the dtype it computes in). A fused Q/K/V projection holds
one group of factors per part.

Resident DiT: switching adapter re-points the buffers at another adapter's device tensors of the same shape (a
bounded device cache). Offloaded DiT (CPU offload, layerwise offload, DLO): the factors are tensors of their
block like its weights, so they stream with it; switching adapter writes the new factors into the blocks' host
masters (`OffloadRuntime.write`), and the scale stays on the device (the offload units skip `LoraScale`).

Under tensor parallelism the factors are cut the way their layer's weight is: B's rows for a column-parallel
layer (A whole), A's columns for a row-parallel one (B whole, the partial products summed with the base's in
its one all-reduce; FP8 row-parallel layers too); a gathered column layer (the AdaLN projection) adds its rows'
product before the gather.

A PDD adapter (h3serve.adapters.pdd) is a LoRA on the same layers plus each block's AdaLN projection, with a bank
of output heads: activating it also sets the DiT's per-step heads (`StepHeads`, fused here once per adapter) and
its AdaLN adapter identity (the AdaLN memo's key), both cleared when another adapter or none is active. A FlashGen
LoRA (h3serve.adapters.flashgen) adapts the AdaLN projections too, the final layer's (`norm_out.linear`) among
them, on native keys that are regrouped onto these layers when read (`read_flashgen_factors`); its AdaLN identity
carries its scale, since the projections' outputs change with it.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from h3serve.accel.fp8 import Fp8Linear
from h3serve.adapters import flashgen
from h3serve.adapters.catalog import read_adapter
from h3serve.adapters.pdd import AUDIO_SHIFT, VIDEO_SHIFT, head_plans, pdd_target_shapes
from h3serve.adapters.serving import slot_rank
from h3serve.adapters.taomate import diffusers_parts, inspect_taomate, is_taomate_dir
from h3serve.errors import RequestError
from h3serve.model.transformer import H3Transformer, StepHeads
from h3serve.parallel.comm import all_gather_dim, all_reduce_wide
from h3serve.parallel.tensor_parallel import (
    Fp8GatheredColumnLinear,
    Fp8RowParallelLinear,
    GatheredColumnLinear,
    RowParallelLinear,
    TensorParallel,
)
from h3serve.rules.adapter_choice import AdapterChoice, FlashGenContract, PddContract


class LoraScale(nn.Module):
    """The 0-dim float32 scale (request scale × alpha / rank) every LoRA layer of one DiT multiplies by."""

    def __init__(self, device: torch.device):
        super().__init__()
        self.register_buffer("value", torch.zeros((), dtype=torch.float32, device=device), persistent=False)


def factor_dtype(base: nn.Module) -> torch.dtype:
    """The dtype a layer's factors are kept in: the dtype it computes in (an FP8 layer's compute dtype)."""
    return base.compute_dtype if isinstance(base, Fp8Linear) else base.weight.dtype


class LoraLinear(nn.Module):
    """A target layer plus low-rank factors: `lora_a` [g·R, in], `lora_b` [g, out/g, R], and the DiT's `scale`.

    `g` groups split the output into equal parts with their own factors (3 for a fused [q | k | v] projection).
    """

    def __init__(self, base: nn.Module, groups: int, slot_rank: int, scale: LoraScale):
        super().__init__()
        self.base = base
        self.groups = groups
        w = base.weight
        dtype = factor_dtype(base)
        # A gathered block's weights are still on the meta device (read piece by piece, h3serve.loading.dit_pieces):
        # its factors start as real zeros in host memory, where the block's unit takes them from.
        where = torch.device("cpu") if w.is_meta else w.device
        a, b = (groups * slot_rank, w.shape[1]), (groups, w.shape[0] // groups, slot_rank)
        self.register_buffer("lora_a", torch.zeros(a, dtype=dtype, device=where), persistent=False)
        self.register_buffer("lora_b", torch.zeros(b, dtype=dtype, device=where), persistent=False)
        self.scale = scale  # shared by the DiT's wrappers (a submodule of each: offload units skip it)

    @property
    def weight(self) -> torch.Tensor:
        return self.base.weight

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype the base computes in (an FP8 base's declared one): what callers cast the input to."""
        return factor_dtype(self.base)

    @property
    def lora_scale(self) -> torch.Tensor:
        return self.scale.value

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        h = F.linear(x, self.lora_a)
        if self.groups == 1:
            d = F.linear(h, self.lora_b[0])
        else:
            d = torch.einsum("...gr,gor->...go", h.unflatten(-1, (self.groups, -1)), self.lora_b).flatten(-2)
        return d * self.scale.value

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base = self.base
        # Row-parallel: the partial low-rank products ride on the base's all-reduce (bf16 partials summed in fp32).
        if isinstance(base, RowParallelLinear):
            y = all_reduce_wide(F.linear(x, base.weight) + self.delta(x), base.group)
        elif isinstance(base, Fp8RowParallelLinear):
            y = all_reduce_wide(base.gemm(x, None) + self.delta(x.to(base.compute_dtype)), base.group)
        elif isinstance(base, GatheredColumnLinear | Fp8GatheredColumnLinear):  # this rank's rows, then the gather
            return all_gather_dim(base.local(x) + self.delta(x), -1, base.group)
        else:
            return base(x) + self.delta(x)
        return y if base.bias is None else y + base.bias


def wrapped_targets(dit: H3Transformer, adaln: bool = False) -> list[tuple[str, tuple[str, ...]]]:
    """(layer path, the adapter target names it holds, in output order) for every LoRA layer of `dit`: the
    attention and FFN projections of every block, and with `adaln` each transformer block's AdaLN projection and
    the final layer's (PDD and FlashGen targets)."""
    main = [f"transformer_blocks.{i}" for i in range(len(dit.transformer_blocks))]
    blocks = main + [f"token_refiner.refiner_blocks.{i}" for i in range(len(dit.token_refiner.refiner_blocks))]
    layers = [(f"{block}.adaln_proj.linear", (f"{block}.adaln_proj.linear",)) for block in main if adaln]
    if adaln:  # the final layer's AdaLN projection: a FlashGen target
        layers.append(("norm_out.linear", ("norm_out.linear",)))
    for block in blocks:
        attn = dit.get_submodule(f"{block}.attn")
        if getattr(attn, "to_qkv", None) is not None:
            layers.append((f"{block}.attn.to_qkv", tuple(f"{block}.attn.to_{p}" for p in "qkv")))
        else:
            layers += [(f"{block}.attn.to_{p}", (f"{block}.attn.to_{p}",)) for p in "qkv"]
        layers += [(f"{block}.{t}", (f"{block}.{t}",)) for t in ("attn.to_out.0", "ff.net.0.proj", "ff.net.2")]
    return layers


def install_lora(dit: H3Transformer, slot_rank: int, scale: LoraScale, adaln: bool = False) -> list[LoraLinear]:
    """Wrap every target layer of `dit` (after Q/K/V fusion, before compile); returns them in `wrapped_targets`
    order. The factors start at zero; `scale` is shared by them all."""
    wrappers = []
    for path, parts in wrapped_targets(dit, adaln):
        base = dit.get_submodule(path)
        if isinstance(base, LoraLinear):
            raise ValueError(f"{path} already carries a LoRA wrapper")
        wrapper = LoraLinear(base, len(parts), slot_rank, scale)
        dit.set_submodule(path, wrapper)
        wrappers.append(wrapper)
    return wrappers


@dataclass(frozen=True)
class HostFactors:
    """One adapter's factors as this rank holds them: target -> (A, B), cut for tensor parallelism; a PDD
    adapter's fused per-step heads (fp32) beside them."""

    rank: int
    unit_scale: float  # alpha / r
    factors: dict[str, tuple[torch.Tensor, torch.Tensor]]
    heads: StepHeads | None = None

    @property
    def nbytes(self) -> int:
        heads = 0 if self.heads is None else sum(t.nbytes for t in vars(self.heads).values())
        return sum(a.nbytes + b.nbytes for a, b in self.factors.values()) + heads


def fused_heads(path: str, contract: PddContract) -> StepHeads:
    """A PDD file's head bank fused per forward: forward k's head is its block's heads weighted by their share of
    the block's step on each modality's own grid (`head_plans`), in fp32."""
    out = {}
    with safe_open(path, framework="pt", device="cpu") as f:
        for head, modality, shift in (("proj_out", "video", VIDEO_SHIFT), ("audio_proj_out", "audio", AUDIO_SHIFT)):
            plan = torch.tensor(head_plans(contract, shift), dtype=torch.float32)  # [F, bank]
            weight, bias = (f.get_tensor(f"{head}.{kind}").float() for kind in ("weight", "bias"))
            out[f"{modality}_weight"] = torch.einsum("kn,noi->koi", plan, weight).contiguous()
            out[f"{modality}_bias"] = torch.einsum("kn,no->ko", plan, bias).contiguous()
    return StepHeads(**out)


def read_taomate_factors(path: str, dit_config: dict) -> HostFactors:
    """A TaoMate-H3 streaming LoRA directory's factors on the diffusers targets (`adapters.taomate.diffusers_parts`:
    the fused Q/K/V's B rows split three ways over one shared A, the FFN input's B halves swapped to [value; gate])."""
    info = inspect_taomate(path, dit_config)
    factors = {}
    with safe_open(str(info.path), framework="pt", device="cpu") as f:
        for native, (key_a, key_b) in info.keys.items():
            a, b = f.get_tensor(key_a), f.get_tensor(key_b)
            for part in diffusers_parts(native, info.rows[native]):
                rows = b[part.start : part.stop]
                if part.swap_halves:
                    gate, value = rows.chunk(2)
                    rows = torch.cat([value, gate])
                factors[part.target] = (a, rows.contiguous())
    return HostFactors(info.rank, info.unit_scale, factors)


def read_flashgen_factors(path: str, dit_config: dict, tp: TensorParallel | None = None) -> HostFactors:
    """A FlashGen file's factors on the diffusers targets (`adapters.flashgen.diffusers_parts`): the grouped Q/K/V's
    B rows regrouped per head into q, k and v over one shared A, the FFN input's [gate; up] swapped to [up; gate];
    under `tp` each target keeps this rank's slice, as for any LoRA."""
    from h3serve.adapters.header import read_header

    found = flashgen.inspect_flashgen(read_header(path), dit_config)
    head_dim = int(dit_config["attention_head_dim"])
    shapes = pdd_target_shapes(dit_config) | {"norm_out.linear": (2 * int(dit_config["hidden_size"]),
                                                                  int(dit_config["time_embed_dim"]))}
    factors = {}
    with safe_open(str(found.lora.path), framework="pt", device="cpu") as f:
        for native, (key_a, key_b) in found.lora.keys.items():
            a, b = f.get_tensor(key_a), f.get_tensor(key_b)
            for part in flashgen.diffusers_parts(native):
                rows = b
                if part.qkv is not None:  # [heads, 3, head_dim, r]: this part of every head
                    rows = b.unflatten(0, (-1, 3, head_dim))[:, part.qkv].flatten(0, 1)
                elif part.swap:
                    gate, up = rows.chunk(2)
                    rows = torch.cat([up, gate])
                factors[part.target] = _tp_slice(a, rows.contiguous(), tp, part.target, shapes[part.target])
    return HostFactors(found.lora.rank, found.lora.unit_scale, factors)


def _tp_slice(
    a: torch.Tensor, b: torch.Tensor, tp: TensorParallel | None, target: str, shape: tuple[int, int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """(A, B) as this tensor-parallel rank holds them: B's rows of a column-parallel layer, A's columns of a
    row-parallel one (whole without `tp`)."""
    ranges = None if tp is None else tp.ranges(f"{target}.weight", shape)
    if ranges is None:
        return a, b
    if ranges[0] == 0:
        return a, TensorParallel.cut_ranges(b, ranges)
    return TensorParallel.cut_ranges(a, ranges), b


def read_factors(path: str, dit_config: dict, tp: TensorParallel | None = None) -> HostFactors:
    """Read a LoRA or PDD file, or a TaoMate-H3 directory (checked against the DiT's targets first), keeping only
    this rank's slices under `tp`."""
    if is_taomate_dir(path):
        if tp is not None:
            raise ValueError("the TaoMate-H3 LoRA runs without tensor parallelism (refused at start-up)")
        return read_taomate_factors(path, dit_config)
    shapes = pdd_target_shapes(dit_config)
    info, pdd = read_adapter(path, dit_config, shapes)
    if isinstance(pdd, FlashGenContract):
        return read_flashgen_factors(str(info.path), dit_config, tp)
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
    heads = None if pdd is None else fused_heads(str(info.path), pdd)
    return HostFactors(info.rank, info.unit_scale, factors, heads)


@dataclass(frozen=True)
class FactorSpec:
    """One wrapper's factor buffers as installed (offload may release them; their shape stays this)."""

    a: torch.Size
    b: torch.Size
    dtype: torch.dtype
    device: torch.device

    @classmethod
    def of(cls, wrapper: LoraLinear) -> FactorSpec:
        return cls(wrapper.lora_a.shape, wrapper.lora_b.shape, wrapper.lora_a.dtype, wrapper.lora_a.device)


def device_factors(
    host: HostFactors | None,
    layers: list[tuple[str, tuple[str, ...]]],
    specs: list[FactorSpec],
    device: torch.device | None = None,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per wrapper, (lora_a, lora_b) as its spec says (on `device` when given): the adapter's factors zero-padded
    to the slot rank; a target the adapter lacks, or every target when `host` is None, stays zero."""
    out = []
    for (_, parts), spec in zip(layers, specs, strict=True):
        where = spec.device if device is None else device
        a = torch.zeros(spec.a, dtype=spec.dtype, device=where)
        b = torch.zeros(spec.b, dtype=spec.dtype, device=where)
        slot = b.shape[-1]
        if host is not None and host.rank > slot:
            raise ValueError(f"adapter rank {host.rank} exceeds the LoRA slot rank {slot} (--max-lora-rank)")
        for g, target in enumerate(parts if host is not None else ()):
            if target in host.factors:
                fa, fb = host.factors[target]
                a[g * slot : g * slot + host.rank] = fa.to(a.dtype)
                b[g, :, : host.rank] = fb.to(b.dtype)
        out.append((a, b))
    return out


class FactorWriter(Protocol):
    """Where the factors of an offloaded DiT live: the host masters of its weight units (`OffloadRuntime`)."""

    def owns(self, module: nn.Module, name: str) -> bool: ...
    def write(self, items: list[tuple[nn.Module, str, torch.Tensor]]) -> None: ...


@dataclass
class ServedDit:
    """One DiT's LoRA layers. `offloaded`: its factors are tensors of its offload units (they move with their
    block); `written`: the adapter whose factors those units hold (None: zeros)."""

    dit: H3Transformer
    layers: list[tuple[str, tuple[str, ...]]]
    wrappers: list[LoraLinear]
    specs: list[FactorSpec]
    scale: LoraScale
    null: list[tuple[torch.Tensor, torch.Tensor]]  # the installed zero factors (a resident DiT's "no adapter")
    offloaded: bool = False
    written: str | None = None


class LRU:
    """A bounded least-recently-used map; `get_or_make` evicts the oldest, then builds a missing value."""

    def __init__(self, capacity: int, on_evict: Callable[[object, object], None] | None = None):
        if capacity < 1:
            raise ValueError(f"an adapter cache holds at least 1 entry, got {capacity}")
        self.capacity = capacity
        self.items: OrderedDict = OrderedDict()
        self.on_evict = on_evict  # (key, value): drop any other reference, so the memory really is freed

    def get_or_make(self, key, make: Callable[[], object]):
        if key in self.items:
            self.items.move_to_end(key)
            return self.items[key]
        # Evict before building: building first holds capacity + 1 values at once (one adapter too many on the
        # device, where the bound is what the planner counted).
        while len(self.items) >= self.capacity:
            old_key, old = self.items.popitem(last=False)
            if self.on_evict is not None:
                self.on_evict(old_key, old)
            del old
        value = make()
        self.items[key] = value
        return value


class LoraRuntime:
    """The LoRA wrappers of the loaded DiTs and the adapters cached in host memory and on the device.

    `loads` counts adapter loads since start-up: "host" (a file read into host memory) and "device" (factors
    placed for the device: a device-cache fill, or an offloaded DiT's units rewritten); switching between cached
    adapters loads nothing."""

    def __init__(
        self,
        dits: dict[str, H3Transformer],
        slot_rank: int,
        max_cpu_loras: int = 4,
        max_loras: int = 2,
        tp: TensorParallel | None = None,
        device: torch.device | None = None,  # of the scale (default: the DiT's); an offloaded DiT's is the engine's
        adaln: bool = False,  # wrap the AdaLN projections too (PDD): only where they stay resident on the device
    ):
        self.tp = tp
        self.adaln = adaln
        self.host = LRU(max_cpu_loras)
        self.device = LRU(max_loras, self._evicted)
        self.device_heads = LRU(max_loras)  # PDD adapters' fused heads on the device, by file
        self.slot_rank = slot_rank
        self.loads = {"host": 0, "device": 0}
        self.writer: FactorWriter | None = None
        self.dits: dict[str, ServedDit] = {}
        for name, dit in dits.items():
            scale = LoraScale(device or next(dit.parameters()).device)
            layers = wrapped_targets(dit, adaln)
            wrappers = install_lora(dit, slot_rank, scale, adaln)
            null = [(w.lora_a, w.lora_b) for w in wrappers]
            self.dits[name] = ServedDit(dit, layers, wrappers, [FactorSpec.of(w) for w in wrappers], scale, null)
        self.active: dict[str, str | None] = dict.fromkeys(dits)

    def scales(self) -> tuple[nn.Module, ...]:
        """The scale modules: they stay on the device whatever the offload placement."""
        return tuple(served.scale for served in self.dits.values())

    def attach_offload(self, writer: FactorWriter) -> None:
        """After the offload runtime placed the DiTs: a DiT whose factors its units own is served by rewriting them."""
        self.writer = writer
        for name, served in self.dits.items():
            owned = {writer.owns(w, buffer) for w in served.wrappers for buffer in ("lora_a", "lora_b")}
            if len(owned) > 1:
                raise RuntimeError(f"{name}: offload placed some LoRA factors and not others")
            served.offloaded = owned == {True}
            if served.offloaded:  # the units hold the factors now: no second host copy of the zero slot
                served.null = []

    def _host_factors(self, choice: AdapterChoice, served: ServedDit) -> HostFactors:
        def read() -> HostFactors:
            self.loads["host"] += 1
            return read_factors(choice.path, dataclasses.asdict(served.dit.config), self.tp)

        return self.host.get_or_make(choice.path, read)

    def activate(self, dit_name: str, choice: AdapterChoice | None) -> None:
        """Point `dit_name`'s wrappers at `choice`'s factors with its scale (None: zero factors, scale 0)."""
        served = self.dits[dit_name]
        host = None if choice is None else self._host_factors(choice, served)
        if served.offloaded:
            self._write(served, choice, host)
        else:
            tensors = served.null
            if host is not None:
                tensors = self.device.get_or_make((dit_name, choice.path), lambda: self._upload(served, host))
            for wrapper, (a, b) in zip(served.wrappers, tensors, strict=True):
                wrapper.lora_a, wrapper.lora_b = a, b
        served.scale.value.fill_(0.0 if host is None else choice.scale * host.unit_scale)
        self.active[dit_name] = None if choice is None else choice.name
        self._set_heads(served, choice, host)

    def _set_heads(self, served: ServedDit, choice: AdapterChoice | None, host: HostFactors | None) -> None:
        """A PDD adapter's per-step heads on the device (cached per adapter), and its AdaLN identity; cleared for
        any other adapter or none."""
        dit = served.dit
        if choice is not None and choice.flashgen is not None and host is not None:  # AdaLN outputs per scale
            dit.step_heads, dit.adaln_adapter = None, f"{choice.path}@{choice.scale * host.unit_scale!r}"
            return
        if host is None or host.heads is None or choice is None:
            dit.step_heads, dit.adaln_adapter = None, ""
            return
        device = served.scale.value.device
        dit.step_heads = self.device_heads.get_or_make(
            choice.path, lambda: StepHeads(**{name: t.to(device) for name, t in vars(host.heads).items()})
        )
        dit.adaln_adapter = choice.path

    def _evicted(self, key: tuple[str, str], tensors: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """A device-cache entry left the cache: a DiT whose wrappers still point at it goes back to the zero
        factors (scale 0, no adapter), or those factors would stay resident beside the next upload."""
        served = self.dits[key[0]]
        if served.offloaded or not tensors or served.wrappers[0].lora_a is not tensors[0][0]:
            return
        for wrapper, (a, b) in zip(served.wrappers, served.null, strict=True):
            wrapper.lora_a, wrapper.lora_b = a, b
        served.scale.value.fill_(0.0)
        self.active[key[0]] = None

    def _upload(self, served: ServedDit, host: HostFactors) -> list[tuple[torch.Tensor, torch.Tensor]]:
        self.loads["device"] += 1
        return device_factors(host, served.layers, served.specs)

    def _write(self, served: ServedDit, choice: AdapterChoice | None, host: HostFactors | None) -> None:
        """An offloaded DiT: its units' host masters get the adapter's factors (zeros for none), once per change."""
        key = None if choice is None else choice.path
        if served.written == key:
            return
        assert self.writer is not None
        tensors = device_factors(host, served.layers, served.specs, torch.device("cpu"))
        items = [
            (w, name, t)
            for w, pair in zip(served.wrappers, tensors, strict=True)
            for name, t in zip(("lora_a", "lora_b"), pair, strict=True)
        ]
        self.writer.write(items)
        served.written = key
        if host is not None:
            self.loads["device"] += 1

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
        lora = plan.lora
        if lora is not None and (lora.pdd is not None or lora.flashgen is not None) and not self.adaln:
            kind = "a PDD adapter" if lora.pdd is not None else "a FlashGen LoRA"
            raise RequestError(
                "lora", f"{lora.name} is {kind}, which this server cannot run: it trains each block's "
                "AdaLN projection, which stays resident only without DiT offload or host-kept AdaLN weights"
            )
        used = dit_for(plan)
        for name in self.dits:
            self.activate(name, plan.lora if name == used else None)


def lora_runtime(
    config, catalog, components, tp: TensorParallel | None, device: torch.device | None = None, adaln: bool = False
) -> EngineLora | None:
    """Wrap the loaded DiTs' target layers when the engine serves LoRA (`catalog`: its adapters, from --lora-path /
    --lora-dir) or real-time sessions (--realtime-lora); None for neither. `adaln`: the AdaLN projections too
    (resident ones only: what a PDD adapter needs)."""
    slot = slot_rank(config, catalog)
    if slot < 1:
        return None
    dits = {name: dit for name in ("transformer", "transformer_ref") if (dit := getattr(components, name)) is not None}
    return EngineLora(dits, slot, config.max_cpu_loras, config.max_loras, tp, device, adaln)
