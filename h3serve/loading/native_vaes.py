"""The native MiniMaxAI VAEs loaded in place: no conversion pass and no second copy on disk.

Parameters are created on the meta device and read tensor by tensor from the memory-mapped source file
(h3serve.loading.tensors); buffers the modules compute themselves (the decoder's RoPE table) are built normally.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch
from accelerate import init_empty_weights

from h3serve.checkpoint import native_config
from h3serve.checkpoint.file_reading import CheckpointError
from h3serve.loading import vae_keys
from h3serve.loading.tensors import iter_tensors, materialize


def load_native_video_vae(folder: Path, dtype: torch.dtype, device: torch.device):
    """`AutoencoderKLMiniMaxH3` from `video_vae/` (wrapper config + `source/` weights in the original names)."""
    from diffusers import AutoencoderKLMiniMaxH3

    config = native_config.video_vae_config(folder)
    weights = native_config.video_vae_weights(folder)
    with init_empty_weights(include_buffers=False):
        model = AutoencoderKLMiniMaxH3.from_config(config)
    heads, head_dim = config["decoder_num_attention_heads"], config["decoder_attention_head_dim"]

    def converted():
        for key, tensor in iter_tensors([weights]):
            try:
                yield from vae_keys.split_native_tensor(key, tensor, heads, head_dim)
            except ValueError as e:
                raise CheckpointError(f"{weights.name}: {e}") from None

    materialize(model, converted(), dtype, device, tuple(AutoencoderKLMiniMaxH3._keep_in_fp32_modules))
    tile, overlap = native_config.video_vae_tiling(folder)
    model.enable_tiling(tile, tile, overlap, overlap)
    return model.to(device).eval()


def load_native_audio_vae(folder: Path, device: torch.device):
    """`AutoencoderKLMiniMaxH3Audio` from `audio_vae/` (metadata.json + config.json; weights in diffusers' names)."""
    from diffusers import AutoencoderKLMiniMaxH3Audio

    config = native_config.audio_vae_config(folder)
    with quiet_weight_norm(), init_empty_weights(include_buffers=False):
        model = AutoencoderKLMiniMaxH3Audio.from_config(config)
    # fp32 by policy, as the diffusers folder loads (every module is in its keep-in-fp32 list)
    materialize(model, iter_tensors([native_config.audio_vae_weights(folder)]), torch.float32, device)
    return model.to(device).eval()


@contextlib.contextmanager
def quiet_weight_norm() -> Iterator[None]:
    """Hide torch's `weight_norm` deprecation warning (the audio VAE's BigVGAN stack uses it on purpose)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*weight_norm.*is deprecated", category=FutureWarning)
        yield
