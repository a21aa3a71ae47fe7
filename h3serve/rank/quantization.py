"""Rank-side FP8 hooks: which kernel path this rank's device runs (logged at start-up), and the text encoder's
quantisation hook for its loaders (the DiT loader calls h3serve.accel.quantize directly)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from h3serve.accel.fp8 import select_kernel
from h3serve.accel.quant_config import QuantizationConfig
from h3serve.accel.quantize import quantize_in_place
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
