"""Fusing adapter edits into the DiT's weights while they load: W + scale·B@A, W + diff, b + diff_b, in fp32.

The edits (`h3serve.adapters.weight_edits.WeightEdits`) are a FastH3 adapter's (scale 1) or, under `--merge-lora`,
the server's one LoRA adapter's (scale · alpha / r). Applied to the stream of (name, tensor) the loader reads,
before FP8 quantisation, tensor-parallel placement and offload: under tensor parallelism each rank adds the slice
of the full fp32 delta that its slice of the weight covers (the same values as fusing the whole weight, then
cutting it). The loader casts the sum to the compute dtype. A weight stored in FP8 is refused: its values are
only meaningful with its scale, which the stream carries separately.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from safetensors import safe_open
from torch import nn

from h3serve.adapters.fasth3 import FastH3File, check_against, read_fasth3
from h3serve.adapters.weight_edits import WeightEdits
from h3serve.parallel.tensor_parallel import TensorParallel

Tensors = Iterator[tuple[str, torch.Tensor]]


def block_names(model: nn.Module) -> list[str]:
    """The 50 + 2 blocks a FastH3 adapter must edit (any DiT: its transformer and token-refiner blocks)."""
    main = [f"transformer_blocks.{i}" for i in range(len(model.transformer_blocks))]
    return main + [f"token_refiner.refiner_blocks.{i}" for i in range(len(model.token_refiner.refiner_blocks))]


def prepare(path: str, model: nn.Module) -> FastH3File:
    """Read and check a FastH3 file against a (meta, unsharded) DiT; `AdapterError` with the reason."""
    adapter = read_fasth3(path)
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    check_against(adapter, shapes, block_names(model))
    return adapter


def delta_of(handle, adapter: WeightEdits, name: str) -> torch.Tensor:
    """The full fp32 edit of parameter `name`: scale · B@A plus its .diff / .diff_b."""
    delta = None
    if name in adapter.low_rank:
        key_a, key_b = adapter.low_rank[name]
        delta = handle.get_tensor(key_b).float() @ handle.get_tensor(key_a).float()
        if adapter.scale != 1.0:
            delta.mul_(adapter.scale)
    if name in adapter.diffs:
        diff = handle.get_tensor(adapter.diffs[name]).float()
        delta = diff if delta is None else delta + diff
    return delta


def shard_delta(handle, adapter: WeightEdits, name: str, tp: TensorParallel | None, whole_rows: bool = False):
    """The fp32 edit of this rank's shard of parameter `name` (the full edit's rows and columns the shard holds);
    `whole_rows`: every column of the shard's rows (an input-split shard's full rows)."""
    delta = delta_of(handle, adapter, name)
    ranges = None if tp is None else tp.ranges(name, tuple(delta.shape))
    if ranges is not None and not (whole_rows and ranges[0] == 1):
        delta = TensorParallel.cut_ranges(delta, ranges)
    return delta


def fused(
    tensors: Tensors, adapter: WeightEdits, tp: TensorParallel | None = None, elsewhere: frozenset[str] = frozenset()
) -> Tensors:
    """`tensors` with every edited parameter replaced by its fp32 sum; every edit must meet its tensor, but those
    of the parameters in `elsewhere` (a streamed block's, fused row by row: h3serve.loading.dit_pieces)."""
    pending = set(adapter.edited) - elsewhere
    with safe_open(str(adapter.path), framework="pt", device="cpu") as f:
        for name, tensor in tensors:
            if name not in pending:
                yield name, tensor
                continue
            pending.discard(name)
            if tensor.dtype.itemsize == 1:  # an FP8 weight: its values mean nothing without its scale
                raise ValueError(f"{adapter.path.name}: {name} is stored in FP8 in the checkpoint; an adapter "
                                 "can be fused only into a full-precision weight")
            yield name, tensor.float() + shard_delta(f, adapter, name, tp)
    if pending:
        raise ValueError(f"{adapter.path.name}: the checkpoint has no tensor for {sorted(pending)[0]}")
