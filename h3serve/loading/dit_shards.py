"""Sliced loading of one DiT shard, from diffusers-named or native (fused QKV, [gate; value]) checkpoints.

Every rank reads only its own rows/columns. A native fused QKV keeps whole heads together, so a shard's
heads are one contiguous row block (interleaved layout) or three (stacked layout); it is then split into
q/k/v exactly as the unsharded loader does, with the local head count. The native SwiGLU input is
[gate; value]: the pair split reads each half's share and the usual conversion swaps the halves. A stored FP8
scale per output row is read with its weight's rows; a per-tensor scale whole.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from h3serve.checkpoint import native_names
from h3serve.loading import dit_keys as native_keys
from h3serve.model.transformer import H3TransformerConfig
from h3serve.parallel.tensor_parallel import Ranges, TensorParallel


def _native_qkv_ranges(tp: TensorParallel, cfg: H3TransformerConfig, layout: native_keys.QkvLayout):
    heads = cfg.num_attention_heads // tp.size
    dh, inner = cfg.attention_head_dim, cfg.inner_dim
    h0 = tp.rank * heads
    if layout == "interleaved":  # [h: q k v] per head
        return 0, [(h0 * 3 * dh, (h0 + heads) * 3 * dh)]
    return 0, [(part * inner + h0 * dh, part * inner + (h0 + heads) * dh) for part in range(3)]


def shard_ranges(
    tp: TensorParallel,
    cfg: H3TransformerConfig,
    key: str,
    shape: tuple[int, ...],
    native: bool,
    qkv_layout: native_keys.QkvLayout,
) -> Ranges | None:
    """The rows (or columns) of stored tensor `key` of `shape` that this rank's shard reads; None: all of it."""
    if not native:
        return tp.ranges(key, shape)
    name = native_names.native_to_diffusers_name(key)
    whole_scale = name.endswith("_scale") and math.prod(shape) == 1
    if name.endswith((".attn.qkv_proj.weight", ".attn.qkv_proj.weight_scale")) and not whole_scale:
        return _native_qkv_ranges(tp, cfg, qkv_layout)
    return tp.ranges(name, shape)  # includes the native [gate; value] FFN input: the pair split reads each half's share


def iter_dit_shards(
    files: list[Path],
    cfg: H3TransformerConfig,
    native: bool,
    qkv_layout: native_keys.QkvLayout,
    tp: TensorParallel,
    wanted: Callable[[str], bool] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """(diffusers name, this rank's tensor) for every weight of the DiT (of the stored keys `wanted` accepts)."""
    local_heads = cfg.num_attention_heads // tp.size
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for key in f.keys():
                if wanted is not None and not wanted(key):
                    continue
                ranges = shard_ranges(tp, cfg, key, tuple(f.get_slice(key).get_shape()), native, qkv_layout)
                block = f.get_tensor(key) if ranges is None else tp.read_ranges(f, key, ranges)
                if not native:
                    yield key, block
                    continue
                name = native_names.native_to_diffusers_name(key)
                yield from native_keys.split_native_tensor(name, block, local_heads, cfg.attention_head_dim, qkv_layout)
