"""The native (MiniMaxAI FL2VA/Ref2VA) component configs in h3serve's (= diffusers') argument names. Torch-free.

Facts from diffusers' `scripts/convert_minimax_h3_to_diffusers.py` (which hard-codes the released values and names
the original keys in comments) and the release's config files:

- DiT `transformer/config.json` uses the sglang-style names (`ffn_hidden_size`, `token_refiner_num_layers`,
  `latents_dim`, `audio_latents_dim`, `timestep_input_dim`, `time_embed_hidden_size`, `rope_inv_freq_len`) and
  carries two derived widths (`adaln_out_features` = 18·hidden, `final_adaln_out_features` = 2·hidden).
- video VAE: a wrapper `video_vae/config.json` (latent statistics, temporal and tiling geometry, `source_path` +
  `source_safetensors_path`) over `video_vae/<source_path>/config.json` in the original CompVis/ViT names.
- audio VAE: `metadata.json` (`metadata.kwargs`, the constructor arguments) and `config.json` (latent statistics);
  the two share the latent width and the sample rate, which must agree.

Values a released file does not carry take the release's value (the converter's constants); the tiny checkpoint
writes the keys marked "h3serve" below to describe its smaller modules.
"""

from __future__ import annotations

from pathlib import Path

from h3serve.checkpoint.file_reading import CheckpointError, read_json

QKV_LAYOUTS = ("interleaved", "stacked")
DEFAULT_QKV_LAYOUT = "interleaved"  # the MiniMaxAI shards; a single-file [q; k; v] export must say "stacked"

# original DiT config name -> ours
DIT_NAMES = {
    "ffn_hidden_size": "ffn_dim",
    "token_refiner_num_layers": "num_refiner_layers",
    "latents_dim": "in_channels",
    "audio_latents_dim": "audio_in_channels",
    "timestep_input_dim": "freq_dim",
    "time_embed_hidden_size": "time_embed_hidden_dim",
    "rope_inv_freq_len": "rope_freq_dim",
}
_DIT_DERIVED = {"adaln_out_features": 18, "final_adaln_out_features": 2}  # multiples of hidden_size


def dit_config(data: dict, where: str = "transformer/config.json") -> tuple[dict, str | None]:
    """A DiT config in either naming -> (config in our names, the `qkv_layout` it declares or None)."""
    out: dict = {}
    for key, value in data.items():
        if key in _DIT_DERIVED or key == "qkv_layout":
            continue
        ours = DIT_NAMES.get(key, key)
        if ours in out and out[ours] != value:
            raise CheckpointError(f"{where}: '{key}' = {value!r} contradicts '{ours}' = {out[ours]!r}")
        out[ours] = value
    hidden = out.get("hidden_size")
    for key, factor in _DIT_DERIVED.items():
        if key in data and hidden is not None and data[key] != factor * hidden:
            raise CheckpointError(f"{where}: '{key}' = {data[key]} but hidden_size {hidden} implies {factor * hidden}")
    layout = data.get("qkv_layout")
    if layout is not None and layout not in QKV_LAYOUTS:
        raise CheckpointError(f"{where}: qkv_layout must be one of {', '.join(QKV_LAYOUTS)}, got {layout!r}")
    return out, layout


def is_native_dit_config(data: dict) -> bool:
    return any(key in data for key in (*DIT_NAMES, *_DIT_DERIVED))


# ------------------------------------------------------------------------------------------------------------
# Video VAE
# ------------------------------------------------------------------------------------------------------------

_VIDEO_SOURCE_DEFAULTS = {
    "in_channels": 3,
    "out_ch": 3,
    "ch": 128,
    "ch_mult": [1, 2, 2, 4, 4, 8],
    "num_res_blocks": 2,
    "space_down": [2, 2, 2, 2, 1, 1],
    "time_down": [1, 2, 2, 1, 1, 1],
    "norm_num_groups": 32,  # h3serve: the release's GroupNorm groups
    "norm_eps": 1e-6,  # h3serve
    "padding_mode": "reflect",
}
# vit_decoder_kwargs name -> (our name, release value when absent)
_VIT_DECODER = {
    "num_layers": ("decoder_num_layers", 36),
    "heads": ("decoder_num_attention_heads", 32),
    "dim_head": ("decoder_attention_head_dim", 64),
    "rope_theta": ("decoder_rope_theta", 100.0),
    "rope_dim_ratio": ("decoder_rope_dim_ratio", 0.75),
    "num_register_tokens": ("decoder_num_register_tokens", 4),  # h3serve: ViT3DDecoder's default
    "ffn_mult": ("decoder_ffn_mult", 4),  # h3serve: FeedForward's default
    "eps": ("decoder_norm_eps", 1e-5),  # h3serve: ViT3DDecoder's default
}
TILE_DEFAULTS = {"vae_tile_size": 256, "vae_tile_overlap_min": 64}


def is_native_video_vae(folder: Path) -> bool:
    path = folder / "config.json"
    return path.is_file() and "source_safetensors_path" in read_json(path)


def _wrapped_file(folder: Path, fields: dict[str, str | None]) -> Path:
    """`folder` joined with the wrapper config's `fields` in order (a None default: required), refused by name
    when the wrapper points at nothing."""
    wrapper = read_json(folder / "config.json")
    path = folder.joinpath(*(str(wrapper[k] if d is None else wrapper.get(k, d)) for k, d in fields.items()))
    if not path.is_file():
        verb = "names" if len(fields) == 1 else "name"
        raise CheckpointError(f"{folder / 'config.json'}: {'/'.join(fields)} {verb} {path}, which does not exist")
    return path


def video_vae_weights(folder: Path) -> Path:
    """`<folder>/<source_path>/<source_safetensors_path>`, refused by name when the wrapper points at nothing."""
    return _wrapped_file(folder, {"source_path": "source", "source_safetensors_path": None})


def video_vae_config(folder: Path) -> dict:
    """`AutoencoderKLMiniMaxH3` arguments from a native `video_vae/` folder (wrapper + source config)."""
    wrapper = read_json(folder / "config.json")
    source_config = video_vae_weights(folder).parent / "config.json"
    src = {**_VIDEO_SOURCE_DEFAULTS, **(read_json(source_config) if source_config.is_file() else {})}
    z = src.get("z_channels", src.get("embed_dim", wrapper.get("latent_channels", 24)))
    if src.get("embed_dim", z) != z:
        raise CheckpointError(f"{source_config}: z_channels {z} != embed_dim {src['embed_dim']}")
    for key in ("latents_mean", "latents_std"):
        if len(wrapper.get(key) or []) != z:
            raise CheckpointError(f"{folder / 'config.json'}: '{key}' must have {z} values (the latent channels)")
    vit = src.get("vit_decoder_kwargs") or {}
    config = {
        "in_channels": src["in_channels"],
        "out_channels": src["out_ch"],
        "latent_channels": z,
        "block_out_channels": [src["ch"] * m for m in src["ch_mult"]],
        "layers_per_block": src["num_res_blocks"],
        "spatial_downsample_factors": list(src["space_down"]),
        "temporal_downsample_factors": list(src["time_down"]),
        "norm_num_groups": src["norm_num_groups"],
        "norm_eps": src["norm_eps"],
        "spatial_padding_mode": src["padding_mode"],
        **{ours: vit.get(name, default) for name, (ours, default) in _VIT_DECODER.items()},
        "clip_length": wrapper.get("vae_clip_length", 17),
        "token_drop": wrapper.get("vae_token_drop", 3),
        "latents_mean": list(wrapper["latents_mean"]),
        "latents_std": list(wrapper["latents_std"]),
    }
    return config


def video_vae_tiling(folder: Path) -> tuple[int, int]:
    """(tile size, minimum overlap) in pixels from the wrapper config."""
    wrapper = read_json(folder / "config.json")
    return tuple(int(wrapper.get(k, v)) for k, v in TILE_DEFAULTS.items())  # type: ignore[return-value]


# ------------------------------------------------------------------------------------------------------------
# Audio VAE
# ------------------------------------------------------------------------------------------------------------

# Hard-coded by the reference for its 32 kHz model (no released file carries them); h3serve reads them from
# metadata.kwargs when present (the tiny checkpoint's smaller modules).
_AUDIO_FIXED = {
    "num_attention_heads": 8,
    "resblock_kernel_sizes": [3, 7, 11],
    "resblock_dilation_sizes": [[1, 3, 5], [1, 3, 5], [1, 3, 5]],
}


def is_native_audio_vae(folder: Path) -> bool:
    return (folder / "metadata.json").is_file() or (
        (folder / "config.json").is_file() and "source_metadata_path" in read_json(folder / "config.json")
    )


def audio_vae_weights(folder: Path) -> Path:
    return _wrapped_file(folder, {"source_safetensors_path": "model.safetensors"})


def audio_vae_config(folder: Path) -> dict:
    """`AutoencoderKLMiniMaxH3Audio` arguments from `metadata.json` + `config.json`, their shared fields checked."""
    wrapper = read_json(folder / "config.json")
    meta_path = folder / str(wrapper.get("source_metadata_path", "metadata.json"))
    kwargs = (read_json(meta_path).get("metadata") or {}).get("kwargs")
    if not isinstance(kwargs, dict):
        raise CheckpointError(f"{meta_path}: no metadata.kwargs (the audio VAE's constructor arguments)")
    if kwargs.get("decoder_type", "bigvgan") != "bigvgan":
        raise CheckpointError(f"{meta_path}: decoder_type {kwargs['decoder_type']!r}; only 'bigvgan' is supported")
    if not kwargs.get("attn_proj", True):
        raise CheckpointError(f"{meta_path}: attn_proj is off; H3's audio VAE has the attention latent projection")
    try:
        channels, rate, rates = kwargs["vae_latent_channels"], kwargs["sample_rate"], list(kwargs["decoder_rates"])
        for label, ours, theirs in (
            ("latent width", channels, wrapper["latent_channels"]),
            ("sample rate", rate, wrapper["sample_rate"]),
        ):
            if ours != theirs:
                raise CheckpointError(
                    f"{folder}: audio VAE {label} disagreement: metadata.json says {ours}, config.json says {theirs}"
                )
        for key in ("latents_mean", "latents_std"):
            if len(wrapper[key]) != channels:
                raise CheckpointError(f"{folder / 'config.json'}: '{key}' must have {channels} values")
        return {
            "encoder_dim": kwargs["encoder_dim"],
            "encoder_rates": list(kwargs["encoder_rates"]),
            "latent_dim": kwargs["latent_dim"],
            "latent_channels": channels,
            "decoder_dim": kwargs["decoder_dim"],
            "decoder_rates": rates,
            "decoder_kernel_sizes": [2 * u - (u % 2) for u in rates],  # the reference's table: 2u even, 2u-1 odd
            **{key: kwargs.get(key, value) for key, value in _AUDIO_FIXED.items()},
            "sampling_rate": rate,
            "latents_mean": list(wrapper["latents_mean"]),
            "latents_std": list(wrapper["latents_std"]),
        }
    except KeyError as e:
        raise CheckpointError(f"{folder}: audio VAE metadata.json/config.json lack {e}") from None
