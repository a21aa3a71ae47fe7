"""Lazy safetensors reading into meta-initialised modules: one tensor at a time, never a whole file.

A model is built on the meta device, then each tensor is read from its memory-mapped safetensors file, cast per
the dtype policy and assigned. Shared by the rank-side loaders (h3serve.loading.components) and the sharded
loaders (h3serve.parallel). `read_rows` reads chosen rows of one tensor (a DiT block's piece under DLO all-gather,
h3serve.loading.dit_pieces).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from h3serve.checkpoint.resolver import CheckpointError


def iter_tensors(files: list[Path], wanted: Callable[[str], bool] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (key, tensor) one at a time from memory-mapped files, optionally only the keys `wanted` accepts."""
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for key in f.keys():
                if wanted is None or wanted(key):
                    yield key, f.get_tensor(key)


# torch's CPU allocator aligns every allocation to 64 bytes; a safetensors tensor read in place keeps its offset
# in the file (a multiple of 8 only), and MKL's CPU GEMM sums in a different order for a weight that is not
# 16-byte aligned (measured: a [48, 32] fp32 linear is 1e-6 apart at the 12 of 16 float offsets that are not),
# so outputs would depend on where a tensor sits in its file: two layouts of one checkpoint, or a re-sharded
# copy, would differ.
CPU_ALIGNMENT = 64


def aligned(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` itself when it is off the CPU or already contiguous and 64-byte aligned, else a fresh copy."""
    if tensor.device.type != "cpu" or (tensor.is_contiguous() and tensor.data_ptr() % CPU_ALIGNMENT == 0):
        return tensor
    return tensor.clone(memory_format=torch.contiguous_format)


def realign(module: nn.Module) -> nn.Module:
    """Give every CPU parameter and buffer of `module` its own aligned, contiguous storage (see `aligned`): for
    modules loaded by diffusers / transformers, which keep memory-mapped views of the file."""
    for sub in module.modules():
        for table in (sub._parameters, sub._buffers):
            for value in table.values():
                if value is None or value.is_meta:
                    continue
                fresh = aligned(value.data)
                if fresh is not value.data:
                    value.data = fresh
    return module


# safetensors' dtype names (a header's "dtype") -> torch dtypes.
STORED_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64, "I32": torch.int32,
    "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
}  # fmt: skip


def read_rows(file: Path, key: str, rows: list[int], columns: tuple[int, int] | None = None) -> torch.Tensor:
    """Rows `rows` (dim 0, in this order) of tensor `key` of `file`, only `columns` of each when given, read run by
    run of consecutive rows through safe_open's `get_slice`: only those bytes are read from the file. A 0-d tensor
    is one row."""
    runs: list[tuple[int, int]] = []
    for row in rows:
        if runs and runs[-1][1] == row:
            runs[-1] = (runs[-1][0], row + 1)
        else:
            runs.append((row, row + 1))
    with safe_open(str(file), framework="pt", device="cpu") as f:
        if not f.get_slice(key).get_shape():
            return f.get_tensor(key).reshape(1)
        sl = f.get_slice(key)
        parts = [sl[a:b] if columns is None else sl[a:b, columns[0] : columns[1]] for a, b in runs]
    if len(parts) == 1:
        return parts[0]
    wire = [p.view(torch.uint8) if p.dtype.itemsize == 1 else p for p in parts]  # no float8 cat on every build
    return torch.cat(wire).view(parts[0].dtype)


def _keeps_fp32(name: str, fp32_modules: tuple[str, ...]) -> bool:
    return any(part in fp32_modules for part in name.split("."))


def load_dtype(
    name: str, arriving: torch.dtype, dtype: torch.dtype, fp32_modules: tuple[str, ...], stored: frozenset[str]
) -> torch.dtype:
    """The dtype tensor `name` is loaded in, arriving in `arriving`: `dtype`, or float32 in the `fp32_modules`;
    names in `stored` (FP8 weights and their scales) and non-float tensors keep the dtype they arrive in."""
    if name in stored or not arriving.is_floating_point:
        return arriving
    return torch.float32 if _keeps_fp32(name, fp32_modules) else dtype


def materialize(
    model: nn.Module,
    tensors: Iterator[tuple[str, torch.Tensor]],
    dtype: torch.dtype,
    device: torch.device,
    fp32_modules: tuple[str, ...] = (),
    stored: frozenset[str] = frozenset(),
    deferred: frozenset[str] = frozenset(),
) -> None:
    """Assign every parameter/buffer of a meta-initialised `model` from `tensors`; all must be present but the
    `deferred` ones (left on the meta device: their values come later, h3serve.loading.dit_pieces).

    Names in `stored` keep the dtype they arrive in (FP8 weights and their scales, h3serve.accel.quantize). Every
    tensor on the CPU gets aligned, contiguous storage, so results do not depend on the file's byte offsets."""
    expected = dict(model.state_dict(keep_vars=True))
    seen: set[str] = set()
    for name, tensor in tensors:
        if name not in expected:
            raise CheckpointError(f"unexpected weight '{name}' for {type(model).__name__}")
        target = expected[name]
        if tuple(target.shape) != tuple(tensor.shape):
            raise CheckpointError(f"weight '{name}' has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}")
        want = load_dtype(name, tensor.dtype, dtype, fp32_modules, stored)
        value = aligned(tensor.to(device=device, dtype=want))
        module_name, _, attr = name.rpartition(".")
        module = model.get_submodule(module_name)
        if isinstance(getattr(module, attr), nn.Parameter):
            setattr(module, attr, nn.Parameter(value, requires_grad=False))
        else:
            module.register_buffer(attr, value)
        seen.add(name)
    missing = sorted(set(expected) - seen - deferred)
    if missing:
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise CheckpointError(f"{len(missing)} weights missing for {type(model).__name__}: {shown}")
