"""The small DiT architecture the model and accel tests share: 2 heads of 32, 2 blocks, 1 refiner block."""

from __future__ import annotations

import torch

from h3serve.model.layout import TEXT_TAG, build_keyframe_layout, patchify
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


def small_dit_inputs(frames: int = 5, seed: int = 1):
    """A keyframe layout's inputs for the small DiT (text rows, `frames` latent frames of 2x4, audio), seeded."""
    g = torch.Generator().manual_seed(seed)
    text_len, lh, lw, audio = 7, 2, 4, 3 * frames
    layout = build_keyframe_layout(torch.full((text_len,), TEXT_TAG), frames, lh, lw, audio, anchors=("first",))
    video = patchify(torch.randn(1, 24, frames + 1, lh, lw, generator=g))[None]
    audio_rows = torch.randn(1, 2 * audio, 32, generator=g)
    text = torch.randn(1, text_len, SMALL_DIT["text_dim"], generator=g)
    timestep, row_index = layout.row_timesteps(0.3, 0.6)
    return video, audio_rows, text, timestep, row_index, layout.packed


def small_dit_outputs(model: H3Transformer, inputs) -> tuple[torch.Tensor, torch.Tensor]:
    """(video, audio) outputs of one forward over `small_dit_inputs`."""
    video, audio, text, timestep, row_index, packed = inputs
    with torch.inference_mode():
        return model(video, audio, model.embed_text(text), timestep, row_index, packed)
