"""The tiny checkpoint in the native MiniMaxAI layout: `FL2VA/` and `Ref2VA/`, as `hf download` lays the release out.

Same weights as the modular tiny checkpoint of the same preset and seed (h3serve.tools.tiny.make_checkpoint builds the
modules), written through h3serve's own inverse maps: the DiT under its original names (per-head interleaved
`qkv_proj`, `[gate; value]` `fc1`, the shipped `rope.inv_freq`, sglang-style config names) in two shards whose
first holds none of the native marker keys; the video VAE as a wrapper config over `source/` (CompVis / ViT names,
fused `to_qkv`, `[gate; up]` `ff.w1`, the unused `decoder.mask_token`); the audio VAE as `metadata.json` +
`config.json`; the schedulers as `sigma_shift_scales`. The shared components live once, in `FL2VA/` (the
Ref2VA folder holds its `model_index.json` and DiT). Every tensor is float32 (the release stores the DiT in
bfloat16 but for its float32 projections): the two layouts of one seed then decode to the same bytes.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

from h3serve.checkpoint import native_names
from h3serve.checkpoint.native_config import DIT_NAMES
from h3serve.loading import dit_keys as dit_keys
from h3serve.loading import vae_keys
from h3serve.tools.tiny import make_checkpoint as tiny
from h3serve.tools.tiny.build_files import file_lock, make_readable, quiet_progress_bars, replace_dir, write_json
from h3serve.tools.tiny.make_components import build_components
from h3serve.tools.tiny.presets import Preset, check_seed, get_preset

MARKER = tiny.MARKER_FILE
_TRANSFORMERS_PARTS = ("text_encoder", "tokenizer", "processor")
_DIT_FILES = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")


def _save(tensors: dict, path: Path, metadata: dict[str, str] | None = None) -> None:
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: tensors[k].contiguous() for k in sorted(tensors)}, str(path), metadata=metadata or {"format": "pt"})


def _dit_config(model) -> dict:
    ours_to_native = {ours: native for native, ours in DIT_NAMES.items()}
    config = {ours_to_native.get(k, k): v for k, v in model.config.items() if not k.startswith("_")}
    config["patch_size"] = list(config["patch_size"])
    config["adaln_out_features"] = 18 * model.config.hidden_size
    config["final_adaln_out_features"] = 2 * model.config.hidden_size
    config["_class_name"] = "MiniMaxH3DiTModel"
    return config


def write_dit(model, folder: Path) -> None:
    """The DiT in native names, interleaved QKV, two shards + an index; markers only in the second shard."""
    from h3serve.model.transformer import RotaryEmbedding3D

    cfg = model.config
    native = dit_keys.diffusers_to_native(model.state_dict(), cfg.attention_head_dim, "interleaved")
    native["rope.inv_freq"] = RotaryEmbedding3D(cfg.rope_freq_dim, cfg.rope_theta).inv_freq
    second = {k for k in native if native_names.is_native_key_set([k])}
    shards = ({k: v for k, v in native.items() if k not in second}, {k: native[k] for k in second})
    for name, tensors in zip(_DIT_FILES, shards, strict=True):
        _save(tensors, folder / name)
    weight_map = {k: _DIT_FILES[int(k in second)] for k in sorted(native)}
    write_json(folder / "model.safetensors.index.json", {"metadata": {}, "weight_map": weight_map})
    write_json(folder / "config.json", _dit_config(model))


def write_video_vae(model, folder: Path) -> None:
    """`video_vae/config.json` (wrapper) over `video_vae/source/{config.json, model.safetensors}`."""
    import torch

    c = model.config
    native = vae_keys.diffusers_to_native(model.state_dict(), c.decoder_attention_head_dim)
    native["decoder.mask_token"] = torch.zeros(1, 1, c.latent_channels)  # a training buffer, never read
    _save(native, folder / "source" / "model.safetensors")
    ch = c.block_out_channels[0]
    source = {
        "in_channels": c.in_channels,
        "out_ch": c.out_channels,
        "z_channels": c.latent_channels,
        "embed_dim": c.latent_channels,
        "ch": ch,
        "ch_mult": [b // ch for b in c.block_out_channels],
        "num_res_blocks": c.layers_per_block,
        "space_down": list(c.spatial_downsample_factors),
        "time_down": list(c.temporal_downsample_factors),
        "norm_num_groups": c.norm_num_groups,
        "norm_eps": c.norm_eps,
        "padding_mode": c.spatial_padding_mode,
        "vit_decoder_kwargs": {
            "num_layers": c.decoder_num_layers,
            "heads": c.decoder_num_attention_heads,
            "dim_head": c.decoder_attention_head_dim,
            "rope_theta": c.decoder_rope_theta,
            "rope_dim_ratio": c.decoder_rope_dim_ratio,
            "num_register_tokens": c.decoder_num_register_tokens,
            "ffn_mult": c.decoder_ffn_mult,
            "eps": c.decoder_norm_eps,
        },
    }
    write_json(folder / "source" / "config.json", source)
    wrapper = {
        "_class_name": "MiniMaxH3VideoVAE",
        "source_path": "source",
        "source_safetensors_path": "model.safetensors",
        "latent_channels": c.latent_channels,
        "latents_mean": list(c.latents_mean),
        "latents_std": list(c.latents_std),
        "vae_clip_length": c.clip_length,
        "vae_token_drop": c.token_drop,
        "vae_tile_size": model.tile_sample_min_height,
        "vae_tile_overlap_min": model.tile_sample_min_overlap_height,
    }
    write_json(folder / "config.json", wrapper)


def write_audio_vae(model, folder: Path) -> None:
    """`audio_vae/{metadata.json, config.json, model.safetensors}` (weights keep diffusers' names)."""
    c = model.config
    _save(model.state_dict(), folder / "model.safetensors")
    kwargs = {
        "encoder_dim": c.encoder_dim,
        "encoder_rates": list(c.encoder_rates),
        "latent_dim": c.latent_dim,
        "vae_latent_channels": c.latent_channels,
        "decoder_dim": c.decoder_dim,
        "decoder_rates": list(c.decoder_rates),
        "sample_rate": c.sampling_rate,
        "decoder_type": "bigvgan",
        "attn_proj": True,
        # h3serve: the reference hard-codes these for its 32 kHz model; the tiny modules are smaller
        "num_attention_heads": c.num_attention_heads,
        "resblock_kernel_sizes": list(c.resblock_kernel_sizes),
        "resblock_dilation_sizes": [list(d) for d in c.resblock_dilation_sizes],
    }
    write_json(folder / "metadata.json", {"metadata": {"kwargs": kwargs}})
    wrapper = {
        "_class_name": "MiniMaxH3AudioVAE",
        "output_channel": 2,
        "sample_rate": c.sampling_rate,
        "source_metadata_path": "metadata.json",
        "source_safetensors_path": "model.safetensors",
        "latent_channels": c.latent_channels,
        "latents_mean": list(c.latents_mean),
        "latents_std": list(c.latents_std),
    }
    write_json(folder / "config.json", wrapper)


def _model_index(partition: str, tasks: list[str], spec: Preset, shifts: dict[str, float]) -> dict:
    return {
        "_class_name": "MiniMaxH3Pipeline",
        "_minimax_h3": {
            "partition": partition,
            "tasks": tasks,
            "sigma_shift_scales": shifts,
            # h3serve: the tiny canvas (the release's defaults are h3serve.rules.validate.ModelDefaults)
            "canvas_short_edge": spec.canvas_short_edge,
            "canvas_max_pixels": spec.canvas_max_pixels,
            "reference_image_short_edge": spec.reference_image_short_edge,
        },
        "scheduler": None,
        "transformer": ["transformer", "MiniMaxH3DiTModel"],
        "video_vae": ["video_vae", "MiniMaxH3VideoVAE"],
        "audio_vae": ["audio_vae", "MiniMaxH3AudioVAE"],
        "text_encoder": ["text_encoder", "MiniMaxH3Qwen3VLHFEncoder"],
        "tokenizer": ["transformers", "Qwen2TokenizerFast"],
        "processor": ["transformers", "Qwen3VLProcessor"],
    }


def build_native_checkpoint(out_dir: str | Path, seed: int = 0, preset: str = "tiny") -> Path:
    """Write the native-layout tiny checkpoint into `out_dir` (absent or empty) and return its path."""
    spec = get_preset(preset)
    seed = check_seed(seed)
    return _write_native(Path(out_dir), build_components(spec, seed), spec, tiny.marker_of(preset, seed))


def native_from_modular(modular_dir: str | Path, out_dir: str | Path) -> Path:
    """The native twin of a built modular tiny checkpoint (its modules read back, its transformers folders copied):
    the same files as `build_native_checkpoint` of its preset and seed, without drawing the weights again."""
    from diffusers import AutoencoderKLMiniMaxH3, MiniMaxH3Scheduler, MiniMaxH3Transformer3DModel

    from h3serve.loading.native_vaes import quiet_weight_norm

    src = Path(modular_dir)
    marker = json.loads((src / MARKER).read_text(encoding="utf-8"))
    with quiet_weight_norm():
        from diffusers import AutoencoderKLMiniMaxH3Audio

        audio_vae = AutoencoderKLMiniMaxH3Audio.from_pretrained(src / "audio_vae")
    parts = {
        "transformer": MiniMaxH3Transformer3DModel.from_pretrained(src / "transformer"),
        "transformer_ref": MiniMaxH3Transformer3DModel.from_pretrained(src / "transformer_ref"),
        "vae": AutoencoderKLMiniMaxH3.from_pretrained(src / "vae"),
        "audio_vae": audio_vae,
        **{name: src / name for name in _TRANSFORMERS_PARTS},
        "scheduler": MiniMaxH3Scheduler.from_pretrained(src / "scheduler"),
        "audio_scheduler": MiniMaxH3Scheduler.from_pretrained(src / "audio_scheduler"),
    }
    return _write_native(Path(out_dir), parts, get_preset(marker["preset"]), marker)


def _write_native(out: Path, parts: dict, spec: Preset, marker: dict) -> Path:
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"refusing to build a checkpoint into non-empty directory {out}")
    shifts = {"video": float(parts["scheduler"].config.shift), "audio": float(parts["audio_scheduler"].config.shift)}
    fl2va, ref2va = out / "FL2VA", out / "Ref2VA"
    write_dit(parts["transformer"], fl2va / "transformer")
    write_dit(parts["transformer_ref"], ref2va / "transformer")
    write_video_vae(parts["vae"], fl2va / "video_vae")
    write_audio_vae(parts["audio_vae"], fl2va / "audio_vae")
    for name in sorted(_TRANSFORMERS_PARTS):  # the modular builder's order: saving the processor marks the tokenizer
        if isinstance(parts[name], Path):  # the same transformers folders as the modular layout: copied verbatim
            shutil.copytree(parts[name], fl2va / name)
        else:
            with quiet_progress_bars():
                parts[name].save_pretrained(str(fl2va / name))
    write_json(fl2va / "model_index.json", _model_index("fl2va", ["t2va", "fl2va"], spec, shifts))
    write_json(ref2va / "model_index.json", _model_index("ref2va", ["ref2va"], spec, shifts))
    make_readable(out)
    write_json(out / MARKER, {**marker, "layout": "native"})
    return out


def ensure_native_checkpoint(preset: str = "tiny", seed: int = 0) -> Path:
    """The cached native checkpoint of `preset`/`seed` (beside the modular one), built first if needed."""
    target = tiny.default_checkpoint_dir(preset, seed).with_name(f"{preset}-seed{seed}-native")
    marker = {**tiny.marker_of(preset, seed), "layout": "native"}

    def complete() -> bool:
        try:
            return json.loads((target / MARKER).read_text(encoding="utf-8")) == marker
        except (OSError, ValueError):
            return False

    if complete():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(target.parent / f".{target.name}.lock"):
        if complete():  # another process built it while this one waited
            return target
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
        try:
            build_native_checkpoint(staging / "c", seed=seed, preset=preset)
            replace_dir(staging / "c", target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return target
