"""The small DiT architecture the model and accel tests share: 2 heads of 32, 2 blocks, 1 refiner block."""

from __future__ import annotations

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
