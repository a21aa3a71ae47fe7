"""Native (MiniMaxAI / ComfyUI) transformer tensors -> diffusers tensors (docs/model.md; the names alone:
h3serve.checkpoint.native_names).

Native checkpoints fuse q/k/v into `attn.qkv_proj` and store the SwiGLU input projection as [gate; value].
The fused QKV row order cannot be read from the file: the MiniMaxAI shards interleave it per head
(`[h0: q k v, h1: q k v, ...]`), single-file exports stack it (`[q; k; v]`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Literal

import torch

from h3serve.checkpoint.native_names import diffusers_to_native_name

QkvLayout = Literal["interleaved", "stacked"]


def _rows(tensor: torch.Tensor) -> torch.Tensor:
    """A 1-byte float tensor as uint8 for row shuffles (cat/stack of float8 is not implemented everywhere)."""
    return tensor.view(torch.uint8) if tensor.dtype.itemsize == 1 and tensor.is_floating_point() else tensor


def _split_qkv(tensor: torch.Tensor, num_heads: int, head_dim: int, qkv_layout: QkvLayout) -> list[torch.Tensor]:
    if tensor.numel() == 1:  # a per-tensor FP8 scale of the fused projection: shared by q, k and v
        return [tensor] * 3
    rows = _rows(tensor)
    if qkv_layout == "interleaved":
        parts = [w.flatten(0, 1) for w in rows.unflatten(0, (num_heads, 3, head_dim)).unbind(1)]
    elif qkv_layout == "stacked":
        parts = list(rows.chunk(3, dim=0))
    else:
        raise ValueError(f"qkv_layout must be 'interleaved' or 'stacked', got {qkv_layout!r}")
    return [p.contiguous().view(tensor.dtype) if p.dtype != tensor.dtype else p for p in parts]


def _swap_halves(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.numel() == 1:
        return tensor
    first, second = _rows(tensor).chunk(2, dim=0)
    return torch.cat([second, first], dim=0).view(tensor.dtype)


def split_native_tensor(
    name: str, tensor: torch.Tensor, num_heads: int, head_dim: int, qkv_layout: QkvLayout
) -> Iterator[tuple[str, torch.Tensor]]:
    """One renamed native tensor -> the diffusers tensors it holds (fused QKV splits into three). An FP8
    checkpoint's `weight_scale` of those layers follows its weight's rows (a per-tensor scale is shared)."""
    for kind in ("weight", "weight_scale"):
        if name.endswith(f".attn.qkv_proj.{kind}"):
            stem = name[: -len(f"qkv_proj.{kind}")]
            parts = _split_qkv(tensor, num_heads, head_dim, qkv_layout)
            yield from ((f"{stem}{p}.{kind}", t) for p, t in zip(("to_q", "to_k", "to_v"), parts, strict=True))
            return
        if name.endswith(f".ff.net.0.proj.{kind}"):  # native [gate; value] -> diffusers [value; gate]
            yield name, _swap_halves(tensor)
            return
    if name == "rope.inv_freq":
        return
    yield name, tensor


def _fuse_qkv(parts: list[torch.Tensor], head_dim: int, qkv_layout: QkvLayout) -> torch.Tensor:
    if parts[0].numel() == 1:  # per-tensor FP8 scales: the fused projection holds one
        if not all(torch.equal(p, parts[0]) for p in parts):
            raise ValueError("per-tensor q/k/v scales differ: a fused native qkv_proj holds one scale")
        return parts[0]
    rows = [_rows(p) for p in parts]
    if qkv_layout == "interleaved":
        fused = torch.stack([x.unflatten(0, (-1, head_dim)) for x in rows], dim=1).flatten(0, 2)  # [H, 3, Dh, ...]
    else:
        fused = torch.cat(rows, dim=0)
    return fused.view(parts[0].dtype)


def diffusers_to_native(
    state_dict: dict[str, torch.Tensor], head_dim: int, qkv_layout: QkvLayout
) -> dict[str, torch.Tensor]:
    """The inverse conversion (for export and tests): diffusers state dict -> native names and fusions (an FP8
    state dict's `weight_scale`s fused with their weights)."""
    out: dict[str, torch.Tensor] = {}
    for key, tensor in state_dict.items():
        native = diffusers_to_native_name(key)
        kind = "weight_scale" if native.endswith(".weight_scale") else "weight"
        if native.endswith(f".attn.to_q.{kind}"):
            parts = [state_dict[key.replace("to_q", name)] for name in ("to_q", "to_k", "to_v")]
            out[native[: -len(f"to_q.{kind}")] + f"qkv_proj.{kind}"] = _fuse_qkv(parts, head_dim, qkv_layout)
        elif native.endswith((f".attn.to_k.{kind}", f".attn.to_v.{kind}")):
            continue
        elif native.endswith(f".mlp.fc1.{kind}"):
            out[native] = _swap_halves(tensor)
        else:
            out[native] = tensor
    return out
