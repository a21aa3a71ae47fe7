"""Rank-side FP8 hooks: which kernel path this rank's device runs (logged at start-up), and the text encoder's
quantisation hook for its loaders (the DiT loader calls h3serve.accel.quantize directly)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from h3serve.accel.fp8 import Fp8Linear, select_kernel
from h3serve.accel.quantize import Rename, fp8_twin, quantize_in_place, stored_fp8
from h3serve.config.quantization_config import QuantizationConfig
from h3serve.loading.tensors import aligned
from h3serve.parallel.tensor_parallel import TensorParallel

TextQuantizer = Callable[[nn.Module, torch.device, TensorParallel | None], object]


def resolve_kernel(
    config: QuantizationConfig | None, device: torch.device, dtype: torch.dtype, log: Callable[[str], None] | None
) -> str:
    """The FP8 kernel path on this device ("weight_only" | "fp8_gemm"), logged once through `log`."""
    if config is None:
        return "weight_only"
    kernel, why = select_kernel(config.kernel, device, dtype)
    if log is not None:
        log(f"quantization {config.describe()}; kernel: {why}")
    return kernel


def text_quantizer(config: QuantizationConfig | None, dtype: torch.dtype, kernel: str) -> TextQuantizer | None:
    """The hook the text-encoder loaders call on the loaded (or sharded) `Qwen3VLModel` before it moves to its
    device; None when the text encoder stays in full precision."""
    quant = config.component("text_encoder") if config is not None else None
    if quant is None:
        return None

    def quantize(model: nn.Module, device: torch.device, tp: TensorParallel | None) -> list[str]:
        return quantize_in_place(model, "text_encoder", quant, dtype, kernel, device, tp)

    return quantize


@torch.no_grad()
def load_stored_fp8(
    model: nn.Module, files: list[Path], rename: Rename, compute_dtype: torch.dtype, kernel: str
) -> list[str]:
    """Swap each linear of a loaded model whose weight the checkpoint stores as F8_E4M3 + `weight_scale` for an
    `Fp8Linear` holding exactly the stored bytes and scale, read from `files` (for a model a library loaded, which
    cast the FP8 weights to its dtype and dropped the scales: transformers' text encoder). Returns their names."""
    stored = stored_fp8(files, rename)
    layers: dict[str, Fp8Linear] = {}
    for name, per_channel in stored.items():
        linear = model.get_submodule(name)
        layer = fp8_twin(linear, per_channel, compute_dtype, kernel, device="meta")
        if linear.bias is not None:
            layer.bias = nn.Parameter(linear.bias.to(compute_dtype), requires_grad=False)
        layers[name] = layer
    for file in files if layers else []:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for key in f.keys():
                module, _, attr = key.rpartition(".")
                for name in rename(module) if attr in ("weight", "weight_scale") else ():
                    if name in layers:
                        layer, tensor = layers[name], aligned(f.get_tensor(key))  # no view of the file
                        if attr == "weight":
                            layer.weight = nn.Parameter(tensor, requires_grad=False)
                        else:
                            layer.weight_scale = tensor.float().reshape(layer.weight_scale.shape).contiguous()
    for name, layer in layers.items():
        model.set_submodule(name, layer.to(model.get_submodule(name).weight.device))
    return sorted(layers)
