"""Tensor parallelism driven by a declarative plan (module-name pattern -> split style), plus sliced loading.

Styles (Megatron's column/row scheme):
  colwise         output features split (whole heads, FFN columns); no communication
  colwise_pair    a fused projection whose output is two halves ([value; gate]): each half split alike
  colwise_gather  output split, then all-gathered: a big projection every rank needs whole (AdaLN tables)
  rowwise         input features split; the partial products are all-reduced, the bias added once after

`shard_module` swaps the planned `nn.Linear`s for shard-shaped ones (on the meta device, before loading);
`TensorParallel.read` reads only this rank's rows/columns of a weight through `safe_open(...).get_slice`.
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn
from torch.distributed import ProcessGroup

from h3serve.accel.fp8 import Fp8Linear
from h3serve.parallel.comm import all_gather_dim, all_reduce_wide

Style = Literal["colwise", "colwise_pair", "colwise_gather", "rowwise"]
STYLES: tuple[str, ...] = ("colwise", "colwise_pair", "colwise_gather", "rowwise")
Ranges = tuple[int, list[tuple[int, int]]]  # (dim, [(start, stop), ...]) of the full tensor to read


class RowParallelLinear(nn.Linear):
    """Holds input features [rank·k/n, (rank+1)·k/n); sums the partial products over the TP group."""

    def __init__(self, in_features: int, out_features: int, bias: bool, group: ProcessGroup | None):
        super().__init__(in_features, out_features, bias=bias)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = all_reduce_wide(F.linear(x, self.weight), self.group)  # bf16 partials summed in fp32
        return y if self.bias is None else y + self.bias

    def fp8_twin(self, per_channel: bool, compute_dtype: torch.dtype, kernel: str, device) -> Fp8Linear:
        bias = self.bias is not None
        args = (self.in_features, self.out_features, bias, per_channel, compute_dtype, kernel)
        return Fp8RowParallelLinear(*args, device=device, group=self.group)


class GatheredColumnLinear(nn.Linear):
    """Holds output features [rank·m/n, (rank+1)·m/n); all-gathers the full output."""

    def __init__(self, in_features: int, out_features: int, bias: bool, group: ProcessGroup | None):
        super().__init__(in_features, out_features, bias=bias)
        self.group = group

    def local(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's output features, before the gather."""
        return super().forward(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return all_gather_dim(self.local(x), -1, self.group)

    def fp8_twin(self, per_channel: bool, compute_dtype: torch.dtype, kernel: str, device) -> Fp8Linear:
        bias = self.bias is not None
        args = (self.in_features, self.out_features, bias, per_channel, compute_dtype, kernel)
        return Fp8GatheredColumnLinear(*args, device=device, group=self.group)


class Fp8RowParallelLinear(Fp8Linear):
    """`RowParallelLinear` with an FP8 weight: the partial products are summed over the TP group, then the bias
    is added once."""

    sums_partials = True

    def __init__(self, *args, group: ProcessGroup | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = all_reduce_wide(self.gemm(x, None), self.group)  # bf16 partials summed in fp32
        return y if self.bias is None else y + self.bias


class Fp8GatheredColumnLinear(Fp8Linear):
    """`GatheredColumnLinear` with an FP8 weight: all-gathers the full output."""

    def __init__(self, *args, group: ProcessGroup | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.group = group

    def local(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's output features, before the gather."""
        return super().forward(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return all_gather_dim(self.local(x), -1, self.group)


@dataclass(frozen=True)
class TensorParallel:
    """One rank's view of a TP group and the plan it applies."""

    rank: int
    size: int
    group: ProcessGroup | None
    plan: Mapping[str, str]

    def __post_init__(self) -> None:
        bad = sorted({s for s in self.plan.values() if s not in STYLES})
        if bad:
            raise ValueError(f"unknown tensor-parallel styles {bad}; choose from: {', '.join(STYLES)}")

    def style(self, module_name: str) -> str | None:
        for pattern, style in self.plan.items():
            if fnmatch.fnmatchcase(module_name, pattern):
                return style
        return None

    # -- modules ---------------------------------------------------------------------------------------------

    def shard_module(self, model: nn.Module) -> list[str]:
        """Replace every planned `nn.Linear` by its shard-shaped counterpart (same parameter names)."""
        replaced = []
        for name, module in list(model.named_modules()):
            style = self.style(name)
            if style is None:
                continue
            if type(module) is not nn.Linear:
                raise TypeError(f"tensor-parallel plan names {name}, a {type(module).__name__}, not an nn.Linear")
            model.set_submodule(name, self._shard_linear(name, module, style))
            replaced.append(name)
        if not replaced:
            raise ValueError(f"the tensor-parallel plan matched no module of {type(model).__name__}")
        return replaced

    def _part(self, n: int, what: str) -> int:
        if n % self.size:
            raise ValueError(f"{what} ({n}) is not divisible by tensor_parallel_size {self.size}")
        return n // self.size

    def _shard_linear(self, name: str, m: nn.Linear, style: str) -> nn.Linear:
        bias = m.bias is not None
        # Built where the original lives (the meta device while loading): no allocation, no random init.
        with torch.device(m.weight.device):
            if style == "rowwise":
                layer: nn.Linear = RowParallelLinear(self._part(m.in_features, name), m.out_features, bias, self.group)
            elif style == "colwise_gather":
                layer = GatheredColumnLinear(m.in_features, self._part(m.out_features, name), bias, self.group)
            else:  # colwise / colwise_pair: plain linears, the split only shows in their shapes
                pair = style == "colwise_pair"
                out = self._part(m.out_features // 2, name) * 2 if pair else self._part(m.out_features, name)
                layer = nn.Linear(m.in_features, out, bias=bias)
        return layer.to(dtype=m.weight.dtype)

    # -- loading ---------------------------------------------------------------------------------------------

    def ranges(self, param_name: str, full_shape: tuple[int, ...]) -> Ranges | None:
        """Which part of the full tensor `param_name` this rank holds; None when it holds all of it."""
        module_name, _, kind = param_name.rpartition(".")
        style = self.style(module_name)
        if style is None:
            return None
        r, n = self.rank, self.size
        if kind == "weight_scale" and (style == "rowwise" or math.prod(full_shape) == 1):
            return None  # an FP8 scale follows its output rows: whole for an input split or a per-tensor scale
        if style == "rowwise":
            if kind == "bias":
                return None  # added once, after the all-reduce
            k = full_shape[1] // n
            return 1, [(r * k, (r + 1) * k)]
        if style == "colwise_pair":
            half = full_shape[0] // 2
            k = half // n
            return 0, [(r * k, (r + 1) * k), (half + r * k, half + (r + 1) * k)]
        k = full_shape[0] // n
        return 0, [(r * k, (r + 1) * k)]

    @staticmethod
    def cut_ranges(full: torch.Tensor, ranges: Ranges) -> torch.Tensor:
        """The given rows (dim 0) or columns (dim 1) of an in-memory tensor, contiguous."""
        dim, spans = ranges
        parts = [full.narrow(dim, a, b - a) for a, b in spans]
        return (parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)).contiguous()

    def cut(self, param_name: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's part of the whole tensor `param_name` held in memory (what `read` reads from a file)."""
        ranges = self.ranges(param_name, tuple(full.shape))
        return full if ranges is None else self.cut_ranges(full, ranges)

    @staticmethod
    def read_ranges(handle, key: str, ranges: Ranges) -> torch.Tensor:
        """Read only the given rows (dim 0) or columns (dim 1) of `key` from an open safetensors file."""
        dim, spans = ranges
        sl = handle.get_slice(key)
        parts = [sl[a:b] if dim == 0 else sl[:, a:b] for a, b in spans]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)

    def read(self, handle, key: str, param_name: str | None = None) -> torch.Tensor:
        """This rank's part of tensor `key` (stored under `param_name` in the model when the names differ)."""
        ranges = self.ranges(param_name or key, tuple(handle.get_slice(key).get_shape()))
        return handle.get_tensor(key) if ranges is None else self.read_ranges(handle, key, ranges)


def iter_sharded(
    files: list[Path],
    tp: TensorParallel,
    rename: Callable[[str], str | None] = lambda key: key,
) -> Iterator[tuple[str, torch.Tensor]]:
    """(model name, this rank's tensor) for every key `rename` maps to a name (None skips the key)."""
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for key in f.keys():
                name = rename(key)
                if name is not None:
                    yield name, tp.read(f, key, name)
