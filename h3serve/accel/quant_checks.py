"""The start-up checks of a QuantizationConfig against the checkpoint and the device (called from
`rank.device_checks.check_engine`, which already resolves the device through torch): an FP8 GEMM asked for where it
cannot run, and exclude patterns that match none of a loaded component's quantised linears."""

from __future__ import annotations

from pathlib import Path

import torch

from h3serve.config.quantization_config import QuantizationConfig, QuantizationError, fp8_gemm_refusal
from h3serve.errors import ConfigError


def dit_linear_names(folder: Path) -> list[str]:
    """The linear layers of the DiT whose config is in `folder` (built on the meta device)."""
    from h3serve.accel.quantize import linear_names
    from h3serve.checkpoint.resolver import read_json
    from h3serve.model.transformer import H3Transformer, H3TransformerConfig

    with torch.device("meta"):
        model = H3Transformer(H3TransformerConfig.from_dict(read_json(folder / "config.json")))
    return linear_names(model)


def text_linear_names(folder: Path) -> list[str]:
    """The linear layers of the truncated `Qwen3VLModel` the text conditioner loads (meta device)."""
    from transformers import AutoConfig, Qwen3VLModel

    from h3serve.accel.quantize import linear_names
    from h3serve.rules import limits

    config = AutoConfig.from_pretrained(folder)
    config.text_config.num_hidden_layers = min(config.text_config.num_hidden_layers, limits.TEXT_ENCODER_LAYER + 1)
    with torch.device("meta"):
        model = Qwen3VLModel._from_config(config)
    return linear_names(model)


def check_quantization(config: QuantizationConfig, model: Path, dits: tuple[str, ...], device: torch.device) -> None:
    """`ConfigError` naming the reason for a kernel path this device lacks or an exclude pattern matching nothing."""
    if config.kernel == "fp8_gemm":
        capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
        refusal = fp8_gemm_refusal(device.type, capability)
        if refusal is not None:
            raise ConfigError(
                f'--diffusion-quantization-config: kernel "fp8_gemm" cannot run here: {refusal}; use "auto" or '
                '"weight_only" (weight-only FP8 runs on any device)'
            )
    try:
        for name, quant in config.components:
            if not quant.exclude:
                continue
            if name == "text_encoder":
                quant.check_excludes(name, text_linear_names(model / "text_encoder"))
            elif name in dits and (model / name / "config.json").exists():
                quant.check_excludes(name, dit_linear_names(model / name))
    except QuantizationError as e:
        raise ConfigError(str(e)) from None
