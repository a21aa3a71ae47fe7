"""Builds a tiny checkpoint every parallel layout fits: 4 DiT heads (TP2×U2) and a 2-KV-head text encoder (TE TP2).

It shares the session tiny checkpoint's VAEs, tokenizer, processor and schedulers (symlinked) and replaces
the two DiTs and the text encoder with deterministic random ones of those shapes.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from h3serve.model.transformer import H3Transformer, H3TransformerConfig
from h3serve.tools.tiny.make_checkpoint import PRESETS

PARALLEL_DIT = {**PRESETS["tiny"].transformer, "num_attention_heads": 4}  # 4 heads: TP2 x U2 needs 4


def randomize_(module: nn.Module, seed: int) -> None:
    """Non-trivial weights: N(0, 1/fan_in) matrices, constants plus N(0, 0.1²) noise, other vectors N(0, 0.02²)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            noise = torch.randn(p.shape, generator=g, dtype=torch.float64)
            flat = p.detach().reshape(-1)
            if flat.numel() > 1 and bool((flat == flat[0]).all()):
                value = float(flat[0]) + 0.1 * noise
            elif p.dim() >= 2:
                value = noise / math.sqrt(p.numel() // p.shape[0])
            else:
                value = 0.02 * noise
            p.copy_(value)


def _write_dit(folder: Path, seed: int) -> None:
    folder.mkdir()
    model = H3Transformer(H3TransformerConfig(**PARALLEL_DIT))
    randomize_(model, seed)
    weights = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(weights, str(folder / "diffusion_pytorch_model.safetensors"))
    (folder / "config.json").write_text(json.dumps({"_class_name": "MiniMaxH3Transformer3DModel", **PARALLEL_DIT}))


def _write_text_encoder(source: Path, folder: Path, seed: int) -> None:
    from transformers import AutoConfig, Qwen3VLForConditionalGeneration

    config = AutoConfig.from_pretrained(source)
    config.text_config.num_key_value_heads = 2  # 2 query heads, 2 KV heads: TP2 splits both
    with torch.random.fork_rng(devices=[]):
        model = Qwen3VLForConditionalGeneration(config)
    randomize_(model, seed)
    model.save_pretrained(str(folder))


def build_parallel_checkpoint(tiny_checkpoint: Path, root: Path) -> Path:
    root.mkdir()
    for entry in tiny_checkpoint.iterdir():
        if entry.name not in ("transformer", "transformer_ref", "text_encoder"):
            (root / entry.name).symlink_to(entry)
    _write_dit(root / "transformer", seed=1)
    _write_dit(root / "transformer_ref", seed=2)
    _write_text_encoder(tiny_checkpoint / "text_encoder", root / "text_encoder", seed=3)
    return root
