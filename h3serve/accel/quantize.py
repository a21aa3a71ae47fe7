"""Quantising a model's linears to FP8 at load, in one place, before offload placement.

Loaders that build on the meta device (the DiT, a tensor-parallel text encoder) call `prepare_fp8` after
tensor-parallel sharding: the selected linears become `Fp8Linear`s and the weight stream is quantised one
tensor at a time on the load device (the full-precision model is never resident). A weight the checkpoint
already stores in FP8 (safetensors F8_E4M3 plus a `weight_scale`) is taken as it is, never re-quantised.
The whole text encoder (loaded by transformers) is quantised in place by `quantize_in_place`, after
`h3serve.loading.quantize_on_load.load_stored_fp8` has put back the stored FP8 weights and scales transformers
cannot load.

Tensor parallelism: a shard's scales are the rows of the one-rank scales. A row-split linear (input features
split) and, per tensor, every split linear take the maxima over the whole weight (one MAX all-reduce per
tensor, in the same key order on every rank), so each shard holds exactly its slice of the one-rank FP8 weight.
The maxima are reduced on a device the group's backend serves (`collective_device`): a component kept in host
memory quantises on the CPU, and an NCCL group takes CUDA tensors only.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
import torch.distributed as dist
from safetensors import safe_open
from torch import nn
from torch.distributed import ProcessGroup

from h3serve.accel.fp8 import FP8, Fp8Linear, Fp8Twin, quantize_fp8, weight_amax
from h3serve.config.quantization_config import ComponentQuant

Tensors = Iterator[tuple[str, torch.Tensor]]
Rename = Callable[[str], tuple[str, ...]]


class Sharding(Protocol):
    """A tensor-parallel shard's plan (h3serve.parallel.tensor_parallel.TensorParallel): which modules are split
    (`style` not None) and the group their maxima are reduced over."""

    group: ProcessGroup | None

    def style(self, module_name: str) -> str | None: ...


@dataclass(frozen=True)
class Fp8Load:
    """What a meta-device loader needs after `prepare_fp8`: the quantised layers by module name."""

    layers: dict[str, Fp8Linear]

    @property
    def stored(self) -> frozenset[str]:
        """Tensor names assigned in the dtype they arrive in (FP8 weights and float32 scales)."""
        return frozenset(n for m in self.layers for n in (f"{m}.weight", f"{m}.weight_scale"))


def linear_names(model: nn.Module) -> list[str]:
    """Every linear layer of `model` (tensor-parallel linears included), in module order."""
    return [n for n, m in model.named_modules() if isinstance(m, nn.Linear | Fp8Linear)]


def selected_linears(model: nn.Module, component: str, quant: ComponentQuant) -> list[str]:
    return [n for n in linear_names(model) if quant.selects(component, n)]


def stored_fp8(files: list[Path], rename: Rename | None = None) -> dict[str, bool]:
    """Module names whose weight a checkpoint stores as F8_E4M3 with a `weight_scale` -> per-channel scales?
    `rename` maps a checkpoint module name to the model's modules it holds (a native fused QKV holds three)."""
    scales: dict[str, tuple[int, ...]] = {}
    fp8: set[str] = set()
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for key in f.keys():
                if key.endswith(".weight_scale"):
                    scales[key[: -len(".weight_scale")]] = tuple(f.get_slice(key).get_shape())
                elif key.endswith(".weight") and f.get_slice(key).get_dtype() == "F8_E4M3":
                    fp8.add(key[: -len(".weight")])
    found = {name: math.prod(scales[name]) > 1 for name in fp8 if name in scales}
    if rename is None:
        return found
    return {model_name: per_channel for name, per_channel in found.items() for model_name in rename(name)}


def fp8_twin(
    layer: nn.Module,
    per_channel: bool,
    compute_dtype: torch.dtype,
    kernel: str,
    device: torch.device | str | None = None,
) -> Fp8Linear:
    device = layer.weight.device if device is None else device
    if isinstance(layer, Fp8Twin):  # a tensor-parallel linear: its twin keeps the collective
        return layer.fp8_twin(per_channel, compute_dtype, kernel, device)
    args = (layer.in_features, layer.out_features, layer.bias is not None, per_channel, compute_dtype, kernel)
    return Fp8Linear(*args, device=device)


def swap_to_fp8(
    model: nn.Module, names: dict[str, bool], compute_dtype: torch.dtype, kernel: str
) -> dict[str, Fp8Linear]:
    """Replace each named linear (module name -> per-channel scales?) by its FP8 twin, on the linear's device."""
    layers = {}
    for name, per_channel in names.items():
        layer = fp8_twin(model.get_submodule(name), per_channel, compute_dtype, kernel)
        model.set_submodule(name, layer)
        layers[name] = layer
    return layers


def prepare_fp8(
    model: nn.Module,
    component: str,
    quant: ComponentQuant | None,
    files: list[Path],
    compute_dtype: torch.dtype,
    kernel: str,
    rename: Rename | None = None,
) -> Fp8Load | None:
    """Swap the linears `quant` selects, plus those the checkpoint stores in FP8, for `Fp8Linear`s (meta model,
    after tensor-parallel sharding). None when nothing is quantised. `rename`: as for `stored_fp8`."""
    names = {n: quant.per_channel for n in selected_linears(model, component, quant)} if quant is not None else {}
    names.update(stored_fp8(files, rename))  # a stored FP8 weight keeps its own scale layout
    if not names:
        return None
    return Fp8Load(swap_to_fp8(model, names, compute_dtype, kernel))


def _needs_whole_amax(layer: Fp8Linear, sharded: bool) -> bool:
    return sharded and (layer.sums_partials or not layer.per_channel)


# The device types each backend's collectives take (gloo's CUDA support is partial: it is given host tensors).
_BACKEND_DEVICES = {"nccl": ("cuda",), "gloo": ("cpu",), "mpi": ("cpu",), "ucc": ("cpu", "cuda"), "xccl": ("xpu",)}


def backend_device_types(backend: str) -> tuple[str, ...]:
    """The device types a process group's backend string serves: "nccl", or a per-device map like
    "cpu:gloo,cuda:nccl"."""
    if ":" in backend:
        return tuple(pair.split(":", 1)[0] for pair in backend.split(","))
    return _BACKEND_DEVICES.get(backend, ("cpu",))


def collective_device(group: ProcessGroup | None, device: torch.device) -> torch.device:
    """Where a collective over `group` can take a tensor living on `device`: `device` itself when the group's
    backend serves its type, else the device the backend serves (NCCL: this rank's current GPU)."""
    served = backend_device_types(str(dist.get_backend(group)))
    if device.type in served:
        return device
    if "cuda" in served:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(served[0])


def _whole_amax(amax: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """The MAX of `amax` over `group`, on `amax`'s device (a few bytes each way when the two differ)."""
    where = collective_device(group, amax.device)
    reduced = amax.to(where)
    dist.all_reduce(reduced, op=dist.ReduceOp.MAX, group=group)
    return reduced.to(amax.device)


def quantizing(tensors: Tensors, load: Fp8Load, device: torch.device, tp: Sharding | None = None) -> Tensors:
    """The weight stream with every quantised layer's weight replaced by (FP8 weight, its scale)."""
    for name, tensor in tensors:
        module_name, _, attr = name.rpartition(".")
        layer = load.layers.get(module_name)
        if layer is None or attr not in ("weight", "weight_scale"):
            yield name, tensor
            continue
        if attr == "weight_scale":  # stored FP8: the checkpoint's scale, in this layer's [rows, 1] layout
            yield name, tensor.float().reshape(layer.weight_scale.shape)
            continue
        if tensor.dtype == FP8:
            yield name, tensor
            continue
        weight = tensor.to(device)
        amax = weight_amax(weight, layer.per_channel)
        if tp is not None and _needs_whole_amax(layer, tp.style(module_name) is not None):
            amax = _whole_amax(amax, tp.group)
        q, scale = quantize_fp8(weight, layer.per_channel, amax)
        del weight
        yield name, q
        yield f"{module_name}.weight_scale", scale


@torch.no_grad()
def quantize_in_place(
    model: nn.Module,
    component: str,
    quant: ComponentQuant,
    compute_dtype: torch.dtype,
    kernel: str,
    work_device: torch.device | None = None,
    tp: Sharding | None = None,
) -> list[str]:
    """Quantise the selected linears of a loaded model (each weight on `work_device`, the FP8 copy kept there);
    returns their names. With `tp`, the model is a tensor-parallel shard (whole-weight maxima, see above). A linear
    that is FP8 already (stored so in the checkpoint) is kept as it is."""
    names = [n for n in selected_linears(model, component, quant) if not isinstance(model.get_submodule(n), Fp8Linear)]
    for name in names:
        linear = model.get_submodule(name)
        device = work_device or linear.weight.device
        layer = fp8_twin(linear, quant.per_channel, compute_dtype, kernel, device="meta")
        weight = linear.weight.to(device)
        amax = weight_amax(weight, quant.per_channel)
        if tp is not None and _needs_whole_amax(layer, tp.style(name) is not None):
            amax = _whole_amax(amax, tp.group)
        q, scale = quantize_fp8(weight, quant.per_channel, amax)
        layer.weight = nn.Parameter(q, requires_grad=False)
        layer.weight_scale = scale
        if linear.bias is not None:
            layer.bias = nn.Parameter(linear.bias.to(device=device, dtype=compute_dtype), requires_grad=False)
        model.set_submodule(name, layer)
    return names
