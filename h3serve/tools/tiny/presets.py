"""The tiny checkpoints' sizes: one `Preset` per name (its DiT and canvas), the VAEs' and the text stack's tiny
configs, shared by every preset (the released ones: docs/model.md §1)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

EOS_TOKEN = "<|endoftext|>"
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
TEXT_LAYERS = 51  # the pipeline reads hidden_states[50] and needs more than 50 decoder layers
TEXT_HIDDEN = 32
PROCESSOR_SIZE = {"shortest_edge": 1024, "longest_edge": 4096}
PROCESSOR_MEAN_STD = (0.5, 0.5, 0.5)
AUDIO_OUTPUT_GAIN = 0.02


@dataclass(frozen=True)
class Preset:
    """Sizes of one checkpoint preset: the DiT config, the pipeline's canvas config values and the VAEs'
    configs (the shared tiny ones unless a preset names its own)."""

    transformer: Mapping[str, Any]
    canvas_short_edge: int
    canvas_max_pixels: int
    reference_image_short_edge: int
    vae: Mapping[str, Any] | None = None  # None: VAE_CONFIG
    audio_vae: Mapping[str, Any] | None = None  # None: AUDIO_VAE_CONFIG
    dit_dtype: str = "float32"  # the dtype the DiTs are stored in

    @property
    def vae_config(self) -> Mapping[str, Any]:
        return VAE_CONFIG if self.vae is None else self.vae

    @property
    def audio_vae_config(self) -> Mapping[str, Any]:
        return AUDIO_VAE_CONFIG if self.audio_vae is None else self.audio_vae


# 4 heads: TP2 x Ulysses 2 fits; 6 blocks: resident-layer counts 0, 1, all-but-2 and all are distinct.
_TINY_TRANSFORMER: Mapping[str, Any] = MappingProxyType(
    {
        "num_attention_heads": 4,
        "attention_head_dim": 32,
        "hidden_size": 48,
        "num_layers": 6,
        "num_refiner_layers": 1,
        "ffn_dim": 64,
        "in_channels": 24,
        "audio_in_channels": 32,
        "text_dim": TEXT_HIDDEN,
        "freq_dim": 32,
        "time_embed_hidden_dim": 48,
        "time_embed_dim": 24,
        "rope_freq_dim": 4,
    }
)

_CPU_BENCH_TRANSFORMER: Mapping[str, Any] = MappingProxyType(
    {
        **_TINY_TRANSFORMER,
        "num_attention_heads": 8,
        "attention_head_dim": 64,
        "hidden_size": 512,
        "num_layers": 4,
        "ffn_dim": 1408,
        "rope_freq_dim": 8,
    }
)

# The released DiT's width (hidden 5,376, 56 heads, FFN 14,336, its time embedding) with 2 blocks and 1 refiner
# block, beside the tiny VAEs and text stack: whole requests whose step time and allocator peak are a full-width
# DiT's, for `h3serve bench --gpu-acceptance` on a GPU (not for CPU tests). Its DiTs are stored in bfloat16, the
# dtype every GPU row runs in (2 x 3.4 GB of files instead of 2 x 6.9 GB in fp32).
_GPU_ACCEPT_TRANSFORMER: Mapping[str, Any] = MappingProxyType(
    {
        "num_attention_heads": 56,
        "attention_head_dim": 128,
        "hidden_size": 5376,
        "num_layers": 2,
        "num_refiner_layers": 1,
        "ffn_dim": 14336,
        "in_channels": 24,
        "audio_in_channels": 32,
        "text_dim": TEXT_HIDDEN,
        "freq_dim": 256,
        "time_embed_hidden_dim": 5376,
        "time_embed_dim": 2688,
        "rope_freq_dim": 16,
    }
)


VAE_CONFIG: Mapping[str, Any] = MappingProxyType(
    {
        "latent_channels": 24,
        "block_out_channels": (8,) * 6,
        "layers_per_block": 1,
        "norm_num_groups": 4,
        "decoder_num_layers": 1,
        "decoder_num_attention_heads": 2,
        "decoder_attention_head_dim": 16,
        "decoder_ffn_mult": 2,
    }
)

AUDIO_VAE_CONFIG: Mapping[str, Any] = MappingProxyType(
    {
        "encoder_dim": 4,
        "encoder_rates": (2, 4, 4, 5, 5),
        "latent_dim": 64,
        "latent_channels": 32,
        "num_attention_heads": 2,
        "decoder_dim": 128,
        "resblock_kernel_sizes": (3,),
        "resblock_dilation_sizes": ((1, 3),),
    }
)


# The demo checkpoint that `h3serve train-demo` trains (h3serve/demo/training): the released architecture at a
# size meant to learn the demo world on 2 CPU cores within the hour, 11.8 MB at half precision. The video VAE decoder
# is wider than the random tiny one's (it has to draw the object's edges at sub-latent positions); the audio VAE has
# two resblock kernels (3, 7) so that its 32 kHz decoder trains in minutes.
_DEMO_TRANSFORMER: Mapping[str, Any] = MappingProxyType(
    {
        **_TINY_TRANSFORMER,
        "num_attention_heads": 4,
        "attention_head_dim": 32,
        "hidden_size": 96,
        "num_layers": 6,
        "ffn_dim": 256,
        "time_embed_hidden_dim": 96,
        "time_embed_dim": 32,
        # 4 RoPE frequencies an axis: at the released 10000 they are 1, 0.1, 0.01 and 0.001 a unit, and only 0.1
        # tells neighbouring latent frames (6.7 units apart) and tokens (11.3) apart without wrapping; at 100 they
        # are 1, 0.32, 0.1 and 0.032, and three do (docs/demo_lab_notebook.md, run 14).
        "rope_theta": 100.0,
    }
)

DEMO_VAE_CONFIG: Mapping[str, Any] = MappingProxyType(
    {
        **VAE_CONFIG,
        "block_out_channels": (8, 16, 32, 32, 64, 64),
        "decoder_num_layers": 3,
        "decoder_num_attention_heads": 4,
        "decoder_attention_head_dim": 32,
        "decoder_ffn_mult": 4,
    }
)

DEMO_AUDIO_VAE_CONFIG: Mapping[str, Any] = MappingProxyType(
    {**AUDIO_VAE_CONFIG, "resblock_kernel_sizes": (3, 7), "resblock_dilation_sizes": ((1, 3), (1, 3))}
)

PRESETS: dict[str, Preset] = {
    "tiny": Preset(_TINY_TRANSFORMER, canvas_short_edge=64, canvas_max_pixels=64 * 128, reference_image_short_edge=64),
    "cpu-bench": Preset(
        _CPU_BENCH_TRANSFORMER, canvas_short_edge=256, canvas_max_pixels=448 * 256, reference_image_short_edge=256
    ),
    "gpu-accept": Preset(
        _GPU_ACCEPT_TRANSFORMER,
        canvas_short_edge=768,
        canvas_max_pixels=1344 * 768,
        reference_image_short_edge=768,
        dit_dtype="bfloat16",
    ),
    "demo": Preset(
        _DEMO_TRANSFORMER,
        canvas_short_edge=64,
        canvas_max_pixels=64 * 128,
        reference_image_short_edge=64,
        vae=DEMO_VAE_CONFIG,
        audio_vae=DEMO_AUDIO_VAE_CONFIG,
    ),
}


def get_preset(name: str) -> Preset:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}") from None


def check_seed(seed: int) -> int:
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be a non-negative int, got {seed!r}")
    return seed
