"""Checks of the installation around the model: the environment, and one real request."""

from __future__ import annotations

import dataclasses
import os
import tempfile
import time
from pathlib import Path

import torch

from h3serve.accel import attention
from h3serve.tools.selftest.core import CheckFailed, SelftestContext


def environment(ctx: SelftestContext) -> tuple[str, dict]:
    """Devices, free memory, driver / CUDA / cuDNN / NCCL / torch versions, usable attention backends and FP8."""
    data: dict = {"torch": torch.__version__, "device": str(ctx.device), "dtype": str(ctx.dtype).split(".")[-1]}
    data["attention_backends"] = attention.usable_backends(ctx.device, ctx.dtype)
    if ctx.cuda:
        free, total = torch.cuda.mem_get_info(ctx.device)
        props = torch.cuda.get_device_properties(ctx.device)
        data.update(
            gpus=[torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
            free_gib=round(free / 2**30, 1), total_gib=round(total / 2**30, 1),
            capability=f"{props.major}.{props.minor}", cuda=torch.version.cuda,
            cudnn=torch.backends.cudnn.version(), nccl=".".join(map(str, torch.cuda.nccl.version())),
            driver=_driver(),
            fp8_gemm=(props.major, props.minor) >= (8, 9),  # torch._scaled_mm on FP8 tensor cores: Ada / Hopper+
        )
        figure = (f"{len(data['gpus'])}x {data['gpus'][0]} ({data['free_gib']} of {data['total_gib']} GiB free), "
                  f"CUDA {data['cuda']}, cuDNN {data['cudnn']}, NCCL {data['nccl']}, driver {data['driver']}, "
                  f"torch {data['torch']}; FP8 GEMM {'yes' if data['fp8_gemm'] else 'no (weight-only FP8)'}")
        if free < 2**30:
            raise CheckFailed(f"{figure}: under 1 GiB free on {ctx.device}; another process holds the GPU")
    else:
        figure = f"CPU only ({os.cpu_count()} CPUs), torch {data['torch']}; FP8: weight-only"
    figure += f"; attention: {', '.join(data['attention_backends'])}"
    return figure, data


def _driver() -> str:
    try:
        import subprocess

        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _request(ctx: SelftestContext, request, inspect=None) -> tuple[str, dict]:
    """`request` through the real engine (the engine flags, the selftest's checkpoint; loaded once), muxed and
    probed; `inspect(path)`, when given, checks the MP4 further and returns a figure to add."""
    from h3serve.config.engine_config import EngineConfig
    from h3serve.media.mp4 import write_mp4
    from h3serve.media.output_probe import check_output_contract, probe
    from h3serve.rank.model_runner import ModelRunner

    if "engine" not in ctx.shared:
        config: EngineConfig = dataclasses.replace(ctx.engine_config, model=Path(ctx.model))
        start = time.perf_counter()
        ctx.shared["engine"] = ModelRunner(config)
        ctx.shared["load_s"] = time.perf_counter() - start
    engine, load_s = ctx.shared["engine"], ctx.shared["load_s"]
    plan = engine.plan(request)
    start = time.perf_counter()
    out = engine.generate(plan)
    run_s = time.perf_counter() - start
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "selftest.mp4"
        write_mp4(path, out.video, out.audio)
        result = probe(path)
        problems = check_output_contract(result)
        if problems:
            raise CheckFailed(f"the MP4 breaks the output contract (read by {result.reader}): {'; '.join(problems)}")
        extra = f"; {inspect(path)}" if inspect is not None else ""
    figure = f"{plan.num_frames} frames {plan.width}x{plan.height}, {plan.steps} steps: engine load {load_s:.1f} s, " \
             f"request {run_s:.1f} s; MP4 meets the output contract (read by {result.reader}){extra}"
    return figure, {"load_s": load_s, "request_s": run_s}


def end_to_end(ctx: SelftestContext) -> tuple[str, dict]:
    """One T2VA request through the real engine (the engine flags), written as an MP4 and probed against the
    output contract. On the shipped demo checkpoint (the default) the request is the demo's, and the MP4 must show
    and sound what it asks for (`ctx.demo`: the demo world's checks): what a dtype, a kernel or a parallel layout
    must keep. On any other checkpoint, a small request whose content nobody can check."""
    from h3serve.rules.request import GenerationRequest

    if ctx.demo is None:
        return _request(ctx, GenerationRequest(prompt="selftest: a lighthouse at dusk", width=64, height=64, steps=3,
                                               duration_s=4, seed=1))
    return _request(ctx, ctx.demo.request, ctx.demo.verdict)


def end_to_end_continuation(ctx: SelftestContext) -> tuple[str, dict]:
    """A two-window continuation (the second window is guided by the first one's latents, on the device)."""
    from h3serve.rules.request import GenerationRequest

    return _request(ctx, GenerationRequest(
        prompt="selftest: waves", width=32, height=32, steps=1, duration_s=6, seed=2, long_video=True,
        long_video_mode="continuation", continuation_window_frames=107))
