"""The DiT's architecture (`H3TransformerConfig`): plain data, no torch, so the parallel degree checks and the
planner can read a checkpoint's shapes in a process that never loads torch."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields


@dataclass(frozen=True)
class H3TransformerConfig:
    """Architecture of the DiT. Defaults are the released model; field names match diffusers' config.json."""

    num_attention_heads: int = 56
    attention_head_dim: int = 128
    hidden_size: int = 5376
    num_layers: int = 50
    num_refiner_layers: int = 2
    ffn_dim: int = 14336
    in_channels: int = 24
    audio_in_channels: int = 32
    patch_size: tuple[int, int, int] = (1, 2, 2)
    text_dim: int = 5120
    freq_dim: int = 256
    time_embed_hidden_dim: int = 5376
    time_embed_dim: int = 2688
    rope_freq_dim: int = 16
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    qk_norm_eps: float = 1e-5
    final_norm_eps: float = 1e-5

    @classmethod
    def from_dict(cls, data: dict) -> H3TransformerConfig:
        """Build from a diffusers `config.json` dict; bookkeeping keys (`_class_name`, ...) are ignored."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(k for k in data if k not in known and not k.startswith("_"))
        if unknown:
            raise ValueError(f"unknown transformer config keys: {', '.join(unknown)}")
        values = {k: v for k, v in data.items() if k in known}
        if "patch_size" in values:
            values["patch_size"] = tuple(values["patch_size"])
        return cls(**values)

    @property
    def video_patch_dim(self) -> int:
        return self.in_channels * math.prod(self.patch_size)

    @property
    def inner_dim(self) -> int:
        return self.num_attention_heads * self.attention_head_dim
