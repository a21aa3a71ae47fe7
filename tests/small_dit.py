"""The small DiT architecture the model and accel tests share: 2 heads of 32, 2 blocks, 1 refiner block."""

from __future__ import annotations

import torch

from h3serve.model.transformer import H3Transformer, H3TransformerConfig

SMALL_DIT = dict(
    num_attention_heads=2,
    attention_head_dim=32,
    hidden_size=48,
    num_layers=2,
    num_refiner_layers=1,
    ffn_dim=64,
    text_dim=32,
    freq_dim=32,
    time_embed_hidden_dim=48,
    time_embed_dim=24,
    rope_freq_dim=4,
)


def random_small_dit() -> H3Transformer:
    """The small DiT with seeded N(0, 0.2) weights (large enough that every block changes its input)."""
    torch.manual_seed(0)
    model = H3Transformer(H3TransformerConfig(**SMALL_DIT)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    return model
