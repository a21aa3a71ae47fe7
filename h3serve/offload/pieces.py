"""A rank's piece of an all-gathered block (DLO all-gather): the block's flat per-dtype layout, and the piece cut
from its tensors, or read from their sources when the block was never loaded whole.

Each rank keeps 1/G of every streamed block (h3serve.offload.units.GatheredUnit): the block's tensors laid end to
end in one flat buffer per dtype, cut in G equal pieces. Under DLO all-gather the DiT loader leaves the streamed
blocks on the meta device and registers a `RowSource` for each of their tensors (h3serve.loading.dit_pieces); the cut
asks a source only for the rows its stretch of the piece covers (a partial row at each end), so a rank reads about
1/G of the blocks from the checkpoint and no whole block exists in its host memory.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn


class RowSource(Protocol):
    """How to produce any rows of one tensor that is not in memory."""

    @property
    def shape(self) -> tuple[int, ...]: ...

    @property
    def dtype(self) -> torch.dtype: ...

    def rows(self, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) along dim 0 (a 0-d tensor is one row), in `dtype`."""
        ...


class PieceSources:
    """The sources of meta tensors, by (module, tensor name): filled by the loader, read when a unit cuts its piece."""

    def __init__(self) -> None:
        self._sources: dict[tuple[int, str], tuple[nn.Module, RowSource]] = {}  # the module keeps its id valid

    def add(self, module: nn.Module, name: str, source: RowSource) -> None:
        self._sources[(id(module), name)] = (module, source)

    def get(self, module: nn.Module, name: str) -> RowSource | None:
        found = self._sources.get((id(module), name))
        return None if found is None else found[1]

    def __len__(self) -> int:
        return len(self._sources)


Value = torch.Tensor | RowSource  # a tensor in memory, or its source


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def elements(value: Value, start: int, stop: int) -> torch.Tensor:
    """Elements [start, stop) of `value` flattened; a source is asked for the rows that hold them only."""
    if isinstance(value, torch.Tensor):
        return value.reshape(-1)[start:stop]
    shape = tuple(value.shape)
    per_row = _numel(shape[1:]) if shape else 1
    first, last = start // per_row, -(-stop // per_row)
    rows = value.rows(first, last).reshape(-1)
    return rows[start - first * per_row : stop - first * per_row]


def flat_layout(
    entries: list[tuple[torch.dtype, int, int]], granule: int
) -> tuple[list[int], dict[torch.dtype, int]]:
    """(offset in elements of each entry in its dtype's flat buffer, elements of each flat buffer) for entries
    (dtype, numel, the byte misalignment to keep): each entry starts at its misalignment modulo `granule`."""
    offsets: list[int] = []
    ends: dict[torch.dtype, int] = {}  # in bytes
    for dtype, numel, want in entries:
        end = ends.get(dtype, 0)
        start = end + (want - end) % granule
        offsets.append(start // dtype.itemsize)
        ends[dtype] = start + numel * dtype.itemsize
    return offsets, {dtype: -(-n // dtype.itemsize) for dtype, n in ends.items()}


def piece_size(total: int, size: int) -> int:
    """Elements in each of the `size` equal pieces of a flat buffer of `total` (the last one zero-padded)."""
    return -(-total // size)


def cut_piece(
    values: list[Value], offsets: list[int], dtype: torch.dtype, total: int, rank: int, size: int
) -> torch.Tensor:
    """Piece `rank` of `size` of the `dtype` flat buffer of `total` elements in which `values` (those of `dtype`)
    sit at `offsets`: exactly the slice of the whole buffer (zeros where no value is), built without it."""
    piece = piece_size(total, size)
    lo, hi = rank * piece, (rank + 1) * piece
    out = torch.zeros(piece, dtype=dtype)
    for value, start in zip(values, offsets, strict=True):
        if value.dtype != dtype:
            continue
        first, last = max(start, lo), min(start + _numel(tuple(value.shape)), hi)
        if first < last:
            out[first - lo : last - lo] = elements(value, first - start, last - start)
    return out
