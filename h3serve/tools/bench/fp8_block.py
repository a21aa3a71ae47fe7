"""`h3serve bench --fp8-block`: the error one DiT block adds in FP8, against the same block in full precision.

One `TransformerBlock` at a preset's width with random weights (normal, std 1/sqrt(fan-in), so activations keep
their scale, plus a few outlier weights per layer), one random packed input; the block's own contribution
(output − input) is compared, FP8 per channel and per tensor against float32: relative L2 error, cosine, SNR.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch
from torch import nn

from h3serve.accel.quantize import quantize_in_place
from h3serve.config.quantization_config import ComponentQuant
from h3serve.model.transformer import NUM_MODALITIES, H3TransformerConfig, RotaryEmbedding3D, TransformerBlock


@dataclass(frozen=True)
class BlockError:
    granularity: str
    relative_l2: float
    cosine: float
    snr_db: float


class _Holder(nn.Module):
    """One block under the DiT's module name, so the DiT's quantisation patterns select its linears."""

    def __init__(self, block: TransformerBlock):
        super().__init__()
        self.transformer_blocks = nn.ModuleList([block])


def _random_block(cfg: H3TransformerConfig, generator: torch.Generator) -> TransformerBlock:
    block = TransformerBlock(cfg)
    with torch.no_grad():
        for name, p in block.named_parameters():
            if p.ndim == 2:
                p.copy_(torch.randn(p.shape, generator=generator) / math.sqrt(p.shape[1]))
                rows = torch.arange(p.shape[0])
                cols = torch.randint(0, p.shape[1], (p.shape[0],), generator=generator)
                p[rows, cols] *= 8.0  # one outlier per output channel
            elif name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=generator) * 0.02)
    return block.eval()


def block_errors(cfg: H3TransformerConfig, rows: int, seed: int = 0) -> list[BlockError]:
    """FP8 per channel and per tensor against float32, for one block of `cfg` on `rows` packed rows."""
    g = torch.Generator().manual_seed(seed)
    block = _random_block(cfg, g)
    x = torch.randn(1, rows, cfg.hidden_size, generator=g)
    temb = torch.randn(2, cfg.time_embed_dim, generator=g)
    adaln_idx = torch.randint(0, 2 * NUM_MODALITIES, (rows,), generator=g)
    positions = torch.stack([torch.arange(rows) // 64, (torch.arange(rows) // 8) % 8, torch.arange(rows) % 8], -1)
    rotary = RotaryEmbedding3D(cfg.rope_freq_dim, cfg.rope_theta)(positions.double())
    with torch.no_grad():
        reference = block(x, temb, adaln_idx, rotary) - x
        out = []
        for granularity in ("per_channel", "per_tensor"):
            holder = _Holder(copy.deepcopy(block))
            quantize_in_place(holder, "transformer", ComponentQuant(granularity), torch.float32, "weight_only")
            got = holder.transformer_blocks[0](x, temb, adaln_idx, rotary) - x
            err = (got - reference).double()
            ref = reference.double()
            rel = (err.norm() / ref.norm()).item()
            cos = torch.nn.functional.cosine_similarity(got.double().flatten(), ref.flatten(), dim=0).item()
            out.append(BlockError(granularity, rel, cos, -20 * math.log10(rel) if rel > 0 else math.inf))
    return out


def summary(cfg: H3TransformerConfig, rows: int, errors: list[BlockError]) -> str:
    lines = [
        f"One DiT block, hidden {cfg.hidden_size}, {cfg.num_attention_heads}x{cfg.attention_head_dim} heads, FFN "
        f"{cfg.ffn_dim}, {rows} rows, random weights: FP8 (weight-only) against float32, the block's contribution",
        "",
        "| scales | relative L2 error | cosine | SNR (dB) |",
        "|---|---|---|---|",
    ]
    lines += [f"| {e.granularity} | {e.relative_l2:.4f} | {e.cosine:.6f} | {e.snr_db:.1f} |" for e in errors]
    return "\n".join(lines)
