"""The tiny checkpoint's components (DiTs, VAEs, text stack, schedulers) and its modular index."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from h3serve.tools.tiny.make_text import build_processor, build_text_encoder, build_tokenizer
from h3serve.tools.tiny.presets import AUDIO_OUTPUT_GAIN, Preset
from h3serve.tools.tiny.random_init import construct, generator_for, latent_stats, randomize_

if TYPE_CHECKING:
    from torch import Generator, nn


def build_components(spec: Preset, seed: int) -> dict[str, Any]:
    from diffusers import MiniMaxH3Scheduler

    tokenizer = build_tokenizer()
    return {
        "transformer": _build_transformer(spec, generator_for(seed, "transformer")),
        "transformer_ref": _build_transformer(spec, generator_for(seed, "transformer_ref")),
        "vae": _build_vae(spec, generator_for(seed, "vae")),
        "audio_vae": _build_audio_vae(spec, generator_for(seed, "audio_vae")),
        "text_encoder": build_text_encoder(tokenizer, generator_for(seed, "text_encoder")),
        "tokenizer": tokenizer,
        "processor": build_processor(tokenizer),
        "scheduler": MiniMaxH3Scheduler(shift=12.0),
        "audio_scheduler": MiniMaxH3Scheduler(shift=3.0),
    }


def _build_transformer(spec: Preset, generator: Generator) -> nn.Module:
    import torch
    from diffusers import MiniMaxH3Transformer3DModel

    model = construct(MiniMaxH3Transformer3DModel, **spec.transformer)
    randomize_(model, generator)
    return model.to(getattr(torch, spec.dit_dtype)).eval()


def _build_vae(spec: Preset, generator: Generator) -> nn.Module:
    from diffusers import AutoencoderKLMiniMaxH3

    config = spec.vae_config
    mean, std = latent_stats(generator, config["latent_channels"])
    model = construct(AutoencoderKLMiniMaxH3, **config, latents_mean=mean, latents_std=std)
    randomize_(model, generator)
    return model.eval()


def _build_audio_vae(spec: Preset, generator: Generator) -> nn.Module:
    import warnings

    import torch
    from diffusers import AutoencoderKLMiniMaxH3Audio

    config = spec.audio_vae_config
    mean, std = latent_stats(generator, config["latent_channels"])
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*weight_norm.*is deprecated", category=FutureWarning)
        model = construct(AutoencoderKLMiniMaxH3Audio, **config, latents_mean=mean, latents_std=std)
    randomize_(model, generator)
    # The random BigVGAN stack amplifies: its output has std ~10 before the [-1, 1] clamp. Shrink the last conv so
    # that decoded audio stays mostly unclamped (std ~0.1-0.4) and parity tests compare real values.
    with torch.no_grad():
        model.decoder.conv_post.weight_g.mul_(AUDIO_OUTPUT_GAIN)
    return model.eval()


def write_index(out: Path, components: Mapping[str, Any], spec: Preset) -> None:
    """Write ``modular_model_index.json``; components resolve to ``<checkpoint>/<name>`` wherever it is moved."""
    from diffusers import MiniMaxH3Blocks
    from diffusers.pipelines.pipeline_loading_utils import _fetch_class_library_tuple

    pipe = MiniMaxH3Blocks().init_pipeline()
    for name in sorted(components):
        library, class_name = _fetch_class_library_tuple(components[name])
        loading = {
            "pretrained_model_name_or_path": None,
            "subfolder": name,
            "variant": None,
            "revision": None,
            "type_hint": [library, class_name],
        }
        pipe.register_to_config(**{name: [library, class_name, loading]})
    pipe.register_to_config(
        canvas_short_edge=spec.canvas_short_edge,
        canvas_max_pixels=spec.canvas_max_pixels,
        reference_image_short_edge=spec.reference_image_short_edge,
    )
    pipe.save_config(str(out))
