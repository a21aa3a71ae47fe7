"""The memory planner's verdict for the released model under the selftest's engine flags (`h3serve plan`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def released_verdict(device: torch.device, released_plan: Callable[[int], Any]) -> tuple[str, dict]:
    """The planner's "fits" / "does not fit" for the released H3 at 1344x768, 5 s, with the selftest's engine
    flags (parallel layout, offload, quantization: `released_plan` plans with them) on GPUs of this size, and its
    peak."""
    plan = released_plan(torch.cuda.get_device_properties(device).total_memory)
    peak = plan.peak_device_bytes
    word = "fits" if plan.fits else f"does not fit ({plan.shortfall_bytes / 2**30:.1f} GiB short; see h3serve plan)"
    figure = f"released H3 with these flags on GPUs of this size: {word}, peak {peak / 2**30:.1f} GiB per GPU"
    return figure, {"peak": peak, "fits": plan.fits}


def layerwise_stage(cfg, dtype: torch.dtype, shape: tuple[int, int, int], text_rows: int, device_type: str):
    """The planner's denoise stage (`StagePlan`) for the selftest's few-block DiT streamed block by block, the
    DiT alone on the device (no encoder, no VAE, no other DiT): what `h3serve plan` would say for a checkpoint
    holding only this DiT. AdaLN memo off: the selftest's bare forward computes its modulations inside the
    blocks, so the projections stream with them (no AdaLN slot, no modulations)."""
    from dataclasses import replace

    from h3serve.config.offload_config import OffloadConfig
    from h3serve.offload.activations import RequestShape
    from h3serve.offload.inventory import RELEASED, build_inventory, dit_bytes
    from h3serve.offload.planner import Runtime, plan_placement

    # The released inventory supplies the text and VAE shapes the other stages read; its components are dropped.
    released = build_inventory(RELEASED, dits=("transformer",), device_type=device_type, dtype=dtype)
    inv = replace(released, ranks=({"transformer": dit_bytes("transformer", cfg, dtype)},), dits={"transformer": cfg})
    width, height, frames = shape
    request = RequestShape(width, height, frames, "t2va", prompt_tokens=text_rows)
    plan = plan_placement(inv, OffloadConfig(streamed=frozenset({"dit"})), request, runtime=Runtime(memo=False))
    return plan.ranks[0].stage("denoise")
