"""The configs the planner's inventory builds its models from: the released architecture's (no file needed, for
`--preset released`) or a checkpoint folder's (its JSON configs and safetensors headers only), and the sizes the
parallel degrees must divide."""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from pathlib import Path

from h3serve.checkpoint import native_names
from h3serve.checkpoint.file_reading import weight_keys
from h3serve.checkpoint.resolver import CheckpointError, read_layout, safetensors_files
from h3serve.checkpoint.text_encoder_names import checkpoint_module_names
from h3serve.model.transformer_config import H3TransformerConfig
from h3serve.parallel.degrees import ModelDims, read_model_dims
from h3serve.rules import limits

RELEASED = "released"
AUDIO_LATENT_CHANNELS = 32

# Qwen3-VL-32B, the released text encoder (docs/model.md §7): the planner's `--preset released` needs no file.
RELEASED_TEXT_CONFIG = {
    "vocab_size": 151936,
    "hidden_size": 5120,
    "intermediate_size": 25600,
    "num_hidden_layers": 64,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 5_000_000.0,
        "mrope_section": [24, 20, 20],
        "mrope_interleaved": True,
    },
}
RELEASED_VISION_CONFIG = {
    "depth": 27,
    "hidden_size": 1152,
    "intermediate_size": 4304,
    "num_heads": 16,
    "patch_size": 16,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "out_hidden_size": 5120,
    "num_position_embeddings": 2304,
    "deepstack_visual_indexes": [8, 16, 24],
}


@dataclass(frozen=True)
class ModelConfigs:
    """What the inventory builds its meta-device models from."""

    dits: dict[str, H3TransformerConfig]
    vae: dict
    audio_vae: dict
    text: object  # transformers Qwen3VLConfig, truncated to the loaded layers
    stored: dict[str, dict[str, bool]] = field(default_factory=dict)  # component -> linears stored in FP8
    # DiT -> whether its VSA gate projections (`attn.to_gate_compress`, a FastH3 V2 checkpoint's) carry a bias
    gates: dict[str, bool] = field(default_factory=dict)


def _truncated(config):
    config = copy.deepcopy(config)
    total = config.text_config.num_hidden_layers
    if total <= limits.TEXT_ENCODER_LAYER:
        raise CheckpointError(
            f"the text encoder has {total} layers; MiniMax-H3 needs more than {limits.TEXT_ENCODER_LAYER}"
        )
    config.text_config.num_hidden_layers = limits.TEXT_ENCODER_LAYER + 1  # as checkpoint.load_text_conditioner
    return config


def released_configs(dits: tuple[str, ...]) -> ModelConfigs:
    from transformers import Qwen3VLConfig

    text = Qwen3VLConfig(
        text_config=RELEASED_TEXT_CONFIG, vision_config=RELEASED_VISION_CONFIG, tie_word_embeddings=False
    )
    zeros, ones = [0.0] * AUDIO_LATENT_CHANNELS, [1.0] * AUDIO_LATENT_CHANNELS
    return ModelConfigs(
        dits={name: H3TransformerConfig() for name in dits},
        vae={},
        audio_vae={"latents_mean": zeros, "latents_std": ones},
        text=_truncated(text),
    )


def _read_config(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot read {path} ({e})") from None


def checkpoint_configs(root: Path, dits: tuple[str, ...], base: Path | None = None) -> ModelConfigs:
    from transformers import AutoConfig

    layout = read_layout(root, dits, base=base)
    present = [d for d in dits if layout.has(d)]
    if not present:
        raise CheckpointError(f"{layout.root}: none of the DiTs {', '.join(dits)} is in this checkpoint")
    text = _truncated(AutoConfig.from_pretrained(layout.component("text_encoder")))
    return ModelConfigs(
        dits={d: H3TransformerConfig.from_dict(layout.component_config(d)) for d in present},
        vae=layout.component_config("vae"),
        audio_vae=layout.component_config("audio_vae"),
        text=text,
        stored={name: _stored_fp8(layout.component(name), name, text) for name in (*present, "text_encoder")},
        gates={name: bias for name in present if (bias := _sparse_gates(layout.component(name))) is not None},
    )


def _sparse_gates(folder: Path) -> bool | None:
    """Whether a DiT folder's weights carry video sparse attention gates (with a bias: True), from the headers;
    None without gates."""
    gates = [key for key in weight_keys(safetensors_files(folder)) if ".attn.to_gate_compress." in key]
    return any(key.endswith(".bias") for key in gates) if gates else None


def _stored_fp8(folder: Path, name: str, text_config) -> dict[str, bool]:
    """The linears a component's files store in FP8 (from the headers): they load as FP8 whatever the flags."""
    from h3serve.accel.quantize import stored_fp8

    files = safetensors_files(folder)
    if name == "text_encoder":
        return stored_fp8(files, checkpoint_module_names(text_config.text_config.num_hidden_layers))
    native = native_names.is_native_key_set(weight_keys(files))
    return stored_fp8(files, native_names.native_module_names if native else None)


def model_dims(source: str | Path, dits: tuple[str, ...]) -> ModelDims:
    """The sizes the parallel degrees must divide, before any model is built (a bad degree cannot shard)."""
    if source != RELEASED:
        return read_model_dims(Path(source), dits)
    cfg = H3TransformerConfig()
    return ModelDims(
        dit_heads=cfg.num_attention_heads,
        dit_ffn=cfg.ffn_dim,
        dit_hidden=cfg.hidden_size,
        text_heads=RELEASED_TEXT_CONFIG["num_attention_heads"],
        text_kv_heads=RELEASED_TEXT_CONFIG["num_key_value_heads"],
    )
