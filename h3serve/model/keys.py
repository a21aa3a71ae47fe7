"""Native (MiniMaxAI / ComfyUI) transformer key names -> diffusers names (spec §2.8). Pure tensor code.

Native checkpoints fuse q/k/v into `attn.qkv_proj` and store the SwiGLU input projection as [gate; value].
The fused QKV row order cannot be read from the file: the MiniMaxAI shards interleave it per head
(`[h0: q k v, h1: q k v, ...]`), single-file exports stack it (`[q; k; v]`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Literal

import torch

QkvLayout = Literal["interleaved", "stacked"]

_RENAMES = (
    ("token_refiner.blocks.", "token_refiner.refiner_blocks."),
    ("time_embedder.proj_in.", "time_embedder.linear_1."),
    ("time_embedder.proj_out.", "time_embedder.linear_2."),
    ("video_patch_proj.", "proj_in."),
    ("audio_patch_proj.", "audio_proj_in."),
    ("condition_proj.", "context_embedder."),
    ("final_layer.norm.", "norm_out.norm."),
    ("final_layer.adaln_proj.linear.", "norm_out.linear."),
    ("final_layer.video_out.", "proj_out."),
    ("final_layer.audio_out.", "audio_proj_out."),
    (".attn.q_norm.", ".attn.norm_q."),
    (".attn.k_norm.", ".attn.norm_k."),
    (".attn.out_proj.", ".attn.to_out.0."),
    (".mlp.fc1.", ".ff.net.0.proj."),
    (".mlp.fc2.", ".ff.net.2."),
)
_NATIVE_MARKERS = ("video_patch_proj.", "condition_proj.", "final_layer.", "blocks.0.attn.qkv_proj.")


def is_native_key_set(keys: list[str]) -> bool:
    """True when the keys use the native naming (any key with a native-only prefix)."""
    return any(k.startswith(m) or f".{m}" in k for k in keys for m in _NATIVE_MARKERS)


def native_to_diffusers_name(key: str) -> str:
    """Rename one native key (the fused `qkv_proj` keeps its name; `split_native_tensor` splits it)."""
    if key.startswith("blocks."):
        key = "transformer_blocks." + key[len("blocks.") :]
    for old, new in _RENAMES:
        key = key.replace(old, new)
    return key


def split_native_tensor(
    name: str, tensor: torch.Tensor, num_heads: int, head_dim: int, qkv_layout: QkvLayout
) -> Iterator[tuple[str, torch.Tensor]]:
    """One renamed native tensor -> the diffusers tensors it holds (fused QKV splits into three)."""
    if name.endswith(".attn.qkv_proj.weight"):
        if qkv_layout == "interleaved":
            q, k, v = (w.flatten(0, 1) for w in tensor.unflatten(0, (num_heads, 3, head_dim)).unbind(1))
        elif qkv_layout == "stacked":
            q, k, v = tensor.chunk(3, dim=0)
        else:
            raise ValueError(f"qkv_layout must be 'interleaved' or 'stacked', got {qkv_layout!r}")
        stem = name[: -len("qkv_proj.weight")]
        yield from ((stem + "to_q.weight", q), (stem + "to_k.weight", k), (stem + "to_v.weight", v))
    elif name.endswith(".ff.net.0.proj.weight"):
        gate, value = tensor.chunk(2, dim=0)
        yield name, torch.cat([value, gate], dim=0)
    elif name == "rope.inv_freq":
        return
    else:
        yield name, tensor


def diffusers_to_native(
    state_dict: dict[str, torch.Tensor], head_dim: int, qkv_layout: QkvLayout
) -> dict[str, torch.Tensor]:
    """The inverse conversion (for export and tests): diffusers state dict -> native names and fusions."""
    out: dict[str, torch.Tensor] = {}
    for key, tensor in state_dict.items():
        native = key
        for old, new in reversed(_RENAMES):
            native = native.replace(new, old)
        if native.startswith("transformer_blocks."):
            native = "blocks." + native[len("transformer_blocks.") :]
        if native.endswith(".attn.to_q.weight"):
            q, k, v = (state_dict[key.replace("to_q", name)] for name in ("to_q", "to_k", "to_v"))
            stem = native[: -len("to_q.weight")]
            if qkv_layout == "interleaved":
                per_head = [x.unflatten(0, (-1, head_dim)) for x in (q, k, v)]  # [H, Dh, D] each
                out[stem + "qkv_proj.weight"] = torch.stack(per_head, dim=1).flatten(0, 2)
            else:
                out[stem + "qkv_proj.weight"] = torch.cat([q, k, v], dim=0)
        elif native.endswith((".attn.to_k.weight", ".attn.to_v.weight")):
            continue
        elif native.endswith(".mlp.fc1.weight"):
            value, gate = tensor.chunk(2, dim=0)
            out[native] = torch.cat([gate, value], dim=0)
        else:
            out[native] = tensor
    return out
