"""Native (MiniMaxAI `video_vae/source/`) video-VAE key names <-> diffusers `AutoencoderKLMiniMaxH3`. Pure tensor code.

Facts from diffusers' conversion script: the encoder's CompVis names (`encoder.down.{i}.block.{j}`, `nin_shortcut`,
`down.{i}.downsample`) become `down_blocks.{i}.resnets.{j}`, `conv_shortcut`, `downsamplers.0`; the ViT decoder's
`x_embedder` becomes `proj_in`; its fused `attn.to_qkv` (weight and bias) is interleaved per head like the DiT's
and splits into `to_q`/`to_k`/`to_v`; `attn.to_out` gains the `.0` of diffusers' ModuleList; `ff.w1` (stored
`[gate; up]`) becomes `ff.net.0.proj` as `[up; gate]`, `ff.w2` becomes `ff.net.2`; the unused training buffer
`decoder.mask_token` is dropped.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import torch

DROPPED = ("decoder.mask_token",)
_DOWN = re.compile(r"^encoder\.down\.(\d+)\.(.*)$")
_DOWN_BLOCKS = re.compile(r"^encoder\.down_blocks\.(\d+)\.(.*)$")
# (native, diffusers) spellings: inside an encoder down stage (first occurrence each), then anywhere in a key.
_STAGE_PARTS = (("block.", "resnets."), ("nin_shortcut.", "conv_shortcut."), ("downsample.", "downsamplers.0."))
_PAIRS = (
    ("decoder.x_embedder.", "decoder.proj_in."),
    (".attn.to_out.", ".attn.to_out.0."),
    (".ff.w1.", ".ff.net.0.proj."),
    (".ff.w2.", ".ff.net.2."),
)


def _renamed(key: str, to_diffusers: bool) -> str:
    """`key` in the other spelling, the same rules read in either direction."""
    pattern, stage = (_DOWN, "encoder.down_blocks.") if to_diffusers else (_DOWN_BLOCKS, "encoder.down.")
    order = 1 if to_diffusers else -1
    match = pattern.match(key)
    if match:
        rest = match.group(2)
        for pair in _STAGE_PARTS:
            old, new = pair[::order]
            rest = rest.replace(old, new, 1)
        key = f"{stage}{match.group(1)}.{rest}"
    for pair in _PAIRS:
        old, new = pair[::order]
        key = key.replace(old, new)
    return key


def native_to_diffusers_name(key: str) -> str:
    """Rename one native key (a fused `to_qkv` keeps its name; `split_native_tensor` splits it)."""
    return _renamed(key, to_diffusers=True)


def diffusers_to_native_name(name: str) -> str:
    return _renamed(name, to_diffusers=False)


def _swap_halves(tensor: torch.Tensor) -> torch.Tensor:
    first, second = tensor.chunk(2, dim=0)
    return torch.cat([second, first], dim=0)


def split_native_tensor(
    key: str, tensor: torch.Tensor, heads: int, head_dim: int
) -> Iterator[tuple[str, torch.Tensor]]:
    """One native tensor -> the diffusers tensors it holds."""
    if key in DROPPED:
        return
    name = native_to_diffusers_name(key)
    if ".attn.to_qkv." in name:
        expected = heads * 3 * head_dim
        if tensor.shape[0] != expected:
            raise ValueError(
                f"checkpoint key '{key}' has shape {tuple(tensor.shape)}, expected {expected} rows "
                f"({heads} heads x 3 x {head_dim})"
            )
        q, k, v = (t.flatten(0, 1) for t in tensor.unflatten(0, (heads, 3, head_dim)).unbind(1))
        stem, suffix = name.split(".attn.to_qkv.")
        yield from ((f"{stem}.attn.to_{p}.{suffix}", t.contiguous()) for p, t in zip("qkv", (q, k, v), strict=True))
    elif ".ff.net.0.proj." in name:
        yield name, _swap_halves(tensor).contiguous()
    else:
        yield name, tensor


def diffusers_to_native(state_dict: dict[str, torch.Tensor], head_dim: int) -> dict[str, torch.Tensor]:
    """The inverse (for the native tiny checkpoint): diffusers state dict -> native names and fusions."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state_dict.items():
        if ".attn.to_k." in name or ".attn.to_v." in name:
            continue
        native = diffusers_to_native_name(name)
        if ".attn.to_q." in name:
            stem, suffix = native.split(".attn.to_q.")
            parts = [state_dict[name.replace(".to_q.", f".to_{p}.")] for p in "qkv"]
            per_head = [p.unflatten(0, (-1, head_dim)) for p in parts]  # [H, Dh, ...] each
            out[f"{stem}.attn.to_qkv.{suffix}"] = torch.stack(per_head, dim=1).flatten(0, 2).contiguous()
        elif ".ff.w1." in native:
            out[native] = _swap_halves(tensor).contiguous()
        else:
            out[native] = tensor.contiguous()
    return out
