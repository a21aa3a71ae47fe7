"""The diffusers 0.42.1 reference pipeline on an h3serve checkpoint: loading, calling, and timing its stages.

Used by `h3serve bench --peer diffusers` and by the parity tests.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from PIL import Image

from h3serve.loading.tensors import realign
from h3serve.rules.names import DEFAULT_SAMPLE_SOLVER
from h3serve.rules.validate import GenerationPlan

_COMMON = ["text_encoder", "tokenizer", "scheduler", "audio_scheduler", "vae", "audio_vae"]
COMPONENTS = {
    "t2va": [*_COMMON, "transformer"],
    "fl2va": [*_COMMON, "transformer"],
    "ref2va": [*_COMMON, "transformer_ref"],
}

# Pipeline block classes (diffusers.modular_pipelines.minimax_h3) whose calls make up each h3serve stage.
STAGE_BLOCKS = {
    "text_encode": ("MiniMaxH3TextEncoderStep", "MiniMaxH3FL2VATextEncoderStep", "MiniMaxH3Ref2VATextEncoderStep"),
    "vae_encode": ("MiniMaxH3KeyframeVaeEncoderStep", "MiniMaxH3Ref2VAReferenceEncoderStep"),
    "denoise": ("MiniMaxH3DenoiseLoopWrapper",),
    "video_decode": ("MiniMaxH3VideoDecodeStep",),
    "audio_decode": ("MiniMaxH3AudioDecodeStep",),
}


def load_reference_pipeline(
    checkpoint: str | Path, task: str = "t2va", dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> Any:
    """`ModularPipeline` for `task`, with its processor assembled without torchvision."""
    from diffusers import ModularPipeline

    from h3serve.tools.tiny.make_checkpoint import load_processor

    pipe = ModularPipeline.from_pretrained(str(checkpoint), workflow=task)
    pipe.load_components(names=COMPONENTS[task], torch_dtype=dtype)
    pipe.update_components(processor=load_processor(checkpoint))
    if torch.device(device).type != "cpu":
        pipe.to(device)
    for name in COMPONENTS[task]:  # h3serve computes on aligned weights, whatever their offsets in the files
        component = getattr(pipe, name)
        if isinstance(component, torch.nn.Module):
            realign(component)
    return pipe


def reference_inputs(plan: GenerationPlan, images: dict[str, Image.Image] | None = None) -> dict[str, Any]:
    """The reference pipeline's keyword arguments for a plan (keyframes / reference images as PIL).

    The sigma shifts are the checkpoint's scheduler configs: a plan with other shifts cannot be reproduced.
    h3serve's `steps` counts denoiser forwards and diffusers' counts sigma points: N forwards = N + 1 points.
    """
    if plan.pinned_positions is not None:
        raise ValueError("the diffusers peer runs the uniform grid only: a pinned schedule cannot be reproduced")
    if plan.sample_solver != DEFAULT_SAMPLE_SOLVER:
        raise ValueError(f"the diffusers peer steps with {DEFAULT_SAMPLE_SOLVER} only: a {plan.sample_solver} plan "
                         "cannot be reproduced")
    kwargs: dict[str, Any] = dict(
        prompt=plan.prompt,
        height=plan.height,
        width=plan.width,
        num_frames=plan.num_frames,
        num_inference_steps=diffusers_steps(plan.steps),
        generator=torch.Generator().manual_seed(plan.seed),
        output_type="np",
    )
    images = images or {}
    if plan.task == "fl2va":
        kwargs.update({k: images[k] for k in ("image", "last_image") if k in images})
    elif plan.task == "ref2va":
        from diffusers.modular_pipelines.minimax_h3 import MiniMaxH3ImageReference

        kwargs["references"] = [MiniMaxH3ImageReference(image=img) for k, img in sorted(images.items())]
    return kwargs


def diffusers_steps(forwards: int) -> int:
    """diffusers' `num_inference_steps` (sigma points) for h3serve's `steps` (denoiser forwards): N + 1."""
    return forwards + 1


def run_reference(checkpoint: str | Path, prompt: str, num_frames: int, steps: int, seed: int) -> Any:
    """One fp32 T2VA call on the CPU with `steps` denoiser forwards (diffusers at steps + 1); returns the
    pipeline state (`videos`, `audio`, `latents`, ...)."""
    pipe = load_reference_pipeline(checkpoint)
    return pipe(
        prompt=prompt,
        num_frames=num_frames,
        num_inference_steps=diffusers_steps(steps),
        generator=torch.Generator().manual_seed(seed),
        output_type="np",
    )


@contextmanager
def timed_stages(
    durations: dict[str, float], device: torch.device, spans: list[tuple[str, float, float]] | None = None
) -> Iterator[None]:
    """Accumulate wall time per h3serve stage name while the reference pipeline runs (and, into `spans`, each
    block's (stage, start, end) on the time.monotonic clock).

    Wraps the block classes' `__call__` for the duration (so use it in a process that runs nothing else).
    """
    originals: list[tuple[type, Any]] = []

    def wrap(cls: type, stage: str) -> None:
        call = cls.__dict__["__call__"]

        def timed(self, *args: Any, **kwargs: Any) -> Any:
            start = time.monotonic()
            try:
                return call(self, *args, **kwargs)
            finally:
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                end = time.monotonic()
                durations[stage] = durations.get(stage, 0.0) + end - start
                if spans is not None:
                    spans.append((stage, start, end))

        originals.append((cls, call))
        cls.__call__ = timed

    try:
        for stage, names in STAGE_BLOCKS.items():
            for name in names:
                wrap(_block_class(name), stage)
        yield
    finally:
        for cls, call in reversed(originals):
            cls.__call__ = call


def _block_class(name: str) -> type:
    from diffusers.modular_pipelines.minimax_h3 import decoders, denoise, encoders

    for module in (encoders, denoise, decoders):
        if hasattr(module, name):
            return getattr(module, name)
    raise AttributeError(f"diffusers has no MiniMax-H3 block {name!r} (expected diffusers 0.42.1)")
