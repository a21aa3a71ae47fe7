"""A DiT's streamed blocks under DLO all-gather, loaded as row sources: each rank reads only its piece.

Under DLO all-gather each rank keeps 1/G of every streamed block (h3serve.offload.units.GatheredUnit). Loading the
DiT whole and cutting it afterwards held every rank's whole DiTs in host memory at once (8 ranks × 61.7 GiB for the
released pair). Here the blocks stay on the meta device and each of their tensors gets a source that produces any
of its rows from the checkpoint, through the steps the whole-tensor load takes, row by row:

  stored rows  the rows of the stored tensor behind the model tensor's rows: a native fused QKV's rows by head (in
               the checkpoint's qkv_layout), the native [gate; value] swapped, a tensor-parallel shard's rows (an
               input-split shard: the columns of every row). The row map comes from running the loader's own
               transforms (`shard_ranges`, `TensorParallel.cut_ranges`, `split_native_tensor`) on the row numbers,
               so it cannot drift from what they do to the values; read run by run through safe_open's get_slice.
  edits       + the rows of an adapter edit's fp32 delta (computed whole, one tensor at a time, and cut as the whole
               load cuts it).
  FP8          quantised row by row. A per-channel scale needs only its row (read at full width for an input-split
               shard: the scale is the whole row's maximum); so a rank reads the rows of its piece of the FP8
               weights and, for its piece of the scales, the rows they scale: up to 2/G of those weights. A
               per-tensor scale needs the whole weight's maximum, so such a weight is read whole once, one tensor at
               a time. The maxima are read from the file, never all-reduced: the pieces differ by rank, so their
               reads issue no collective (the same maxima: MAX is exact).
  dtype        the loader's rule (h3serve.loading.tensors.load_dtype).
The Q/K/V fusion (`fuse_projections`, run here on the meta blocks) takes its rows from to_q, to_k and to_v in turn,
an FP8 per-tensor scale repeated over its projection's rows (as `Fp8Linear.concat` does).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from h3serve.accel.fp8 import FP8, quantize_fp8, scales_of, weight_amax
from h3serve.accel.quantize import Fp8Load
from h3serve.adapters.weight_edits import WeightEdits
from h3serve.checkpoint import native_names
from h3serve.checkpoint.file_reading import safetensors_header
from h3serve.checkpoint.resolver import CheckpointError
from h3serve.loading import dit_keys as native_keys
from h3serve.loading.dit_shards import shard_ranges
from h3serve.loading.fasth3_fusion import shard_delta
from h3serve.loading.tensors import STORED_DTYPES, load_dtype, read_rows
from h3serve.model.transformer import H3TransformerConfig
from h3serve.offload.pieces import PieceSources, RowSource
from h3serve.offload.placement_plan import DIT_GROUPS, RESIDENT_GROUP
from h3serve.parallel.tensor_parallel import TensorParallel


@dataclass(frozen=True)
class BlockPieces:
    """Load a DiT's streamed blocks as sources, registered in `sources` (DLO all-gather). `adaln_on_host`: the
    transformer blocks' AdaLN projections stay whole in host memory (h3serve.offload.runtime): they load as before."""

    sources: PieceSources
    adaln_on_host: bool

    def lazy(self, name: str) -> bool:
        """Whether DiT tensor `name` (a diffusers name) belongs to a gathered block."""
        if not name.startswith(tuple(f"{group}." for group in DIT_GROUPS)):
            return False
        return not (self.adaln_on_host and name.startswith(f"{RESIDENT_GROUP}.") and ".adaln_proj." in name)


@dataclass(frozen=True)
class StoredRows:
    """The stored rows behind a model tensor: `rows[i]` holds its row i; `columns`: the span of each it holds."""

    file: Path
    key: str
    rows: torch.Tensor  # int64
    columns: tuple[int, int] | None = None

    def read(self, start: int, stop: int, whole_rows: bool = False) -> torch.Tensor:
        """Its rows [start, stop) in the stored dtype and layout; `whole_rows`: every column of them."""
        return read_rows(self.file, self.key, self.rows[start:stop].tolist(), None if whole_rows else self.columns)


@dataclass(frozen=True)
class Edit:
    """An adapter's edit of one parameter (FastH3, a merged LoRA), cut for `tp` as the whole-tensor load cuts it
    (None: the whole edit)."""

    adapter: WeightEdits
    name: str
    tp: TensorParallel | None

    def rows(self, start: int, stop: int, whole_rows: bool = False) -> torch.Tensor:
        with safe_open(str(self.adapter.path), framework="pt", device="cpu") as f:
            return shard_delta(f, self.adapter, self.name, self.tp, whole_rows)[start:stop]


@dataclass(frozen=True)
class Values:
    """A model tensor's rows as the loader's stream carries them: stored, plus an adapter's edit (in fp32)."""

    stored: StoredRows
    edit: Edit | None = None

    def rows(self, start: int, stop: int, whole_rows: bool = False) -> torch.Tensor:
        x = self.stored.read(start, stop, whole_rows)
        return x if self.edit is None else x.float() + self.edit.rows(start, stop, whole_rows)

    def our_columns(self, whole: torch.Tensor) -> torch.Tensor:
        """This shard's columns of rows read with `whole_rows`."""
        span = self.stored.columns
        return whole if span is None else whole[:, span[0] : span[1]]


@dataclass(frozen=True)
class LoadedRows:
    """A model tensor's rows, cast as the loader casts them."""

    values: Values
    shape: tuple[int, ...]
    dtype: torch.dtype

    def rows(self, start: int, stop: int) -> torch.Tensor:
        return self.values.rows(start, stop).to(self.dtype).reshape(stop - start, *self.shape[1:])


@dataclass
class Quantised:
    """One linear's weight, quantised to FP8 row by row as `h3serve.accel.quantize.quantizing` does the whole.

    A per-channel row's maximum is kept once computed (a row's maximum is its own, whatever rows it is read with): a
    rank's pieces of the FP8 weights and of their scales cover mostly the same rows, which are then read once."""

    values: Values  # this rank's rows
    whole: Values  # every row of the unsharded weight (a per-tensor maximum)
    per_channel: bool
    _amax: torch.Tensor | None = field(default=None, init=False)  # per tensor [1, 1]; per channel [rows, 1]
    _known: torch.Tensor | None = field(default=None, init=False)  # per channel: the rows whose maximum is in _amax

    def _whole_amax(self) -> torch.Tensor:
        if self._amax is None:  # the weight read whole once, for its one scale
            self._amax = weight_amax(self.whole.rows(0, len(self.whole.stored.rows), whole_rows=True), False)
        return self._amax

    def _row_amax(self, start: int, stop: int, full: torch.Tensor | None = None) -> torch.Tensor:
        """Rows [start, stop)'s maxima: from `full` (those rows, every column) or kept ones, reading the others."""
        if self._amax is None or self._known is None:
            rows = len(self.values.stored.rows)
            self._amax, self._known = torch.empty(rows, 1), torch.zeros(rows, dtype=torch.bool)
        missing = (~self._known[start:stop]).nonzero()
        if full is None and len(missing):
            a, b = start + int(missing[0]), start + int(missing[-1]) + 1
            start_full, full = a, self.values.rows(a, b, whole_rows=True)
        else:
            start_full = start
        if full is not None:
            self._amax[start_full : start_full + len(full)] = weight_amax(full, True)
            self._known[start_full : start_full + len(full)] = True
        return self._amax[start:stop]

    def weight(self, start: int, stop: int) -> torch.Tensor:
        if not self.per_channel:
            return quantize_fp8(self.values.rows(start, stop), False, self._whole_amax())[0]
        full = self.values.rows(start, stop, whole_rows=True)
        return quantize_fp8(self.values.our_columns(full), True, self._row_amax(start, stop, full))[0]

    def scale(self, start: int, stop: int) -> torch.Tensor:
        return scales_of(self._row_amax(start, stop) if self.per_channel else self._whole_amax())


@dataclass(frozen=True)
class QuantisedPart:
    """The FP8 weight or the scales of a `Quantised` linear."""

    quantised: Quantised
    part: str  # "weight" | "scale"
    shape: tuple[int, ...]
    dtype: torch.dtype

    def rows(self, start: int, stop: int) -> torch.Tensor:
        q = self.quantised
        return q.weight(start, stop) if self.part == "weight" else q.scale(start, stop)


@dataclass(frozen=True)
class ConcatRows:
    """The rows of `parts` one after another (a fused Q/K/V); a one-row part stands for its `rows` equal rows (an FP8
    per-tensor scale repeated over its projection's rows, as `Fp8Linear.concat` does)."""

    parts: tuple[tuple[RowSource, int], ...]  # (source, the rows it fills)

    @property
    def shape(self) -> tuple[int, ...]:
        return (sum(n for _, n in self.parts), *self.parts[0][0].shape[1:])

    @property
    def dtype(self) -> torch.dtype:
        return self.parts[0][0].dtype

    def rows(self, start: int, stop: int) -> torch.Tensor:
        out, base = [], 0
        for source, n in self.parts:
            a, b = max(start, base), min(stop, base + n)
            if a < b:
                if source.shape[0] == n:
                    out.append(source.rows(a - base, b - base))
                else:
                    out.append(source.rows(0, 1).expand(b - a, *source.shape[1:]))
            base += n
        wire = [t.view(torch.uint8) if t.dtype.itemsize == 1 else t for t in out]  # no float8 cat on every build
        return torch.cat(wire).view(self.dtype)


def _row_maps(
    key: str,
    name: str,
    shape: tuple[int, ...],
    cfg: H3TransformerConfig,
    native: bool,
    layout: native_keys.QkvLayout,
    tp: TensorParallel | None,
) -> Iterator[tuple[str, torch.Tensor, tuple[int, int] | None, torch.Tensor]]:
    """(model name, the stored rows of this rank's rows, the columns of each it holds, the stored rows of the whole
    unsharded tensor's) for each model tensor that stored tensor `key` holds."""
    every = torch.arange(shape[0] if shape else 1).unsqueeze(1)
    mine, columns = every, None
    ranges = shard_ranges(tp, cfg, key, shape, native, layout) if tp is not None else None
    if ranges is not None and ranges[0] == 0:
        mine = TensorParallel.cut_ranges(every, ranges)
    elif ranges is not None:
        (columns,) = ranges[1]
    if not native:
        yield name, mine[:, 0], columns, every[:, 0]
        return
    heads, head_dim = cfg.num_attention_heads, cfg.attention_head_dim
    local = heads // tp.size if tp is not None else heads
    whole = dict(native_keys.split_native_tensor(name, every, heads, head_dim, layout))
    for part, rows in native_keys.split_native_tensor(name, mine, local, head_dim, layout):
        yield part, rows[:, 0], columns, whole[part][:, 0]


def _arriving_shape(stored: tuple[int, ...], rows: int, columns: tuple[int, int] | None) -> tuple[int, ...]:
    if not stored:
        return ()
    inner = stored[1:] if columns is None else (columns[1] - columns[0], *stored[2:])
    return (rows, *inner)


@dataclass(frozen=True)
class LoadRules:
    """What the whole-tensor load would do to a block tensor: shard, adapter edit, FP8, dtype."""

    cfg: H3TransformerConfig
    native: bool
    layout: native_keys.QkvLayout
    tp: TensorParallel | None
    dtype: torch.dtype
    fp32_modules: tuple[str, ...]
    fp8: Fp8Load | None
    adapter: WeightEdits | None

    def sources(
        self, file: Path, key: str, info: dict, shapes: dict[str, tuple[int, ...]]
    ) -> Iterator[tuple[str, RowSource]]:
        """(model name, source) of every model tensor that stored tensor `key` (header entry `info`) holds."""
        name = native_names.native_to_diffusers_name(key) if self.native else key
        stored_shape, arriving = tuple(info["shape"]), STORED_DTYPES[info["dtype"]]
        for final, mine, columns, every in _row_maps(key, name, stored_shape, self.cfg, self.native, self.layout,
                                                     self.tp):  # fmt: skip
            if final not in shapes:
                raise CheckpointError(f"unexpected weight '{final}' for the DiT")
            got, want = _arriving_shape(stored_shape, len(mine), columns), shapes[final]
            module, _, attr = final.rpartition(".")
            layer = self.fp8.layers.get(module) if self.fp8 is not None else None
            reshaped = layer is not None and attr == "weight_scale"  # a stored scale takes its layer's layout
            if (math.prod(got) != math.prod(want)) if reshaped else got != want:
                raise CheckpointError(f"weight '{final}' has shape {got}, expected {want}")
            edited = self.adapter is not None and final in self.adapter.edited
            if edited and arriving == FP8:
                raise CheckpointError(f"{self.adapter.path.name}: {final} is stored in FP8 in the checkpoint; an "
                                      "adapter can be fused only into a full-precision weight")
            edit = Edit(self.adapter, final, self.tp) if edited else None
            values = Values(StoredRows(file, key, mine, columns), edit)
            if layer is not None and attr == "weight" and arriving != FP8:  # quantised at load, row by row
                whole_edit = Edit(self.adapter, final, None) if edited else None
                quantised = Quantised(values, Values(StoredRows(file, key, every), whole_edit), layer.per_channel)
                yield final, QuantisedPart(quantised, "weight", want, FP8)
                scale = f"{module}.weight_scale"
                yield scale, QuantisedPart(quantised, "scale", shapes[scale], torch.float32)
                continue
            carried = torch.float32 if edited or reshaped else arriving  # an edit's fp32 sum; a stored scale as float32
            stored = self.fp8.stored if self.fp8 is not None else frozenset()
            yield final, LoadedRows(values, want, load_dtype(final, carried, self.dtype, self.fp32_modules, stored))


def block_sources(
    files: list[Path], rules: LoadRules, lazy: Callable[[str], bool], shapes: dict[str, tuple[int, ...]]
) -> dict[str, RowSource]:
    """The source of every gathered block tensor of the DiT in `files`, by model name (no tensor data is read)."""
    out: dict[str, RowSource] = {}
    for file in files:
        for key, info in safetensors_header(file).items():
            name = native_names.native_to_diffusers_name(key) if rules.native else key
            if key != "__metadata__" and lazy(name):
                out.update(rules.sources(file, key, info, shapes))
    edits = sorted(n for n in rules.adapter.edited if lazy(n) and n not in out) if rules.adapter else []
    if edits:
        raise ValueError(f"{rules.adapter.path.name}: the checkpoint has no tensor for {edits[0]}")
    return out


def place_on_meta(model: nn.Module, sources: dict[str, RowSource]) -> None:
    """Give each sourced tensor of the meta `model` its source's dtype (still on the meta device), so the layers
    built from it (the fused Q/K/V) and the offload units see the dtype the values will have."""
    for name, source in sources.items():
        module_name, _, attr = name.rpartition(".")
        module = model.get_submodule(module_name)
        value = torch.empty(source.shape, dtype=source.dtype, device="meta")
        if isinstance(getattr(module, attr), nn.Parameter):
            setattr(module, attr, nn.Parameter(value, requires_grad=False))
        else:
            module.register_buffer(attr, value)


def _source_of(path: str, attr: str, by_name: dict[str, RowSource]) -> RowSource | None:
    if f"{path}.{attr}" in by_name:
        return by_name[f"{path}.{attr}"]
    if not path.endswith(".attn.to_qkv"):
        return None
    stem = path[: -len("qkv")]  # "<block>.attn.to_"
    try:
        return ConcatRows(
            tuple((by_name[f"{stem}{p}.{attr}"], by_name[f"{stem}{p}.weight"].shape[0]) for p in "qkv")
        )
    except KeyError:
        return None


def bind_sources(model: nn.Module, by_name: dict[str, RowSource], lazy: Callable[[str], bool], into: PieceSources):
    """After the Q/K/V fusion: register a source for every meta tensor of the gathered blocks (by module, so LoRA
    wrappers and other later wiring keep them); `CheckpointError` naming those with none."""
    missing = []
    for group in DIT_GROUPS:
        for path, module in model.get_submodule(group).named_modules(prefix=group):
            for attr, t in [*module._parameters.items(), *module._buffers.items()]:
                if t is None or not t.is_meta or not lazy(f"{path}.{attr}"):
                    continue
                source = _source_of(path, attr, by_name)
                if source is None:
                    missing.append(f"{path}.{attr}")
                    continue
                into.add(module, attr, source)
    if missing:
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise CheckpointError(f"{len(missing)} weights missing for the DiT: {shown}")
