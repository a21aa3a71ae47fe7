"""`h3serve bench --full-depth`: the released DiT at full depth on one GPU, and a Turbo-4 T2VA request end to end.

- **DiT**: the released architecture (`H3TransformerConfig()`: 50 blocks + 2 refiner blocks at hidden 5,376, 33.1 B
  parameters), random N(0, 1/fan_in) weights drawn on the device in bf16 (fp32 where the dtype policy keeps it): no
  file, seconds not minutes. Q/K/V fused, attention installed and compiled (regional) as the engine does.
- **Text encoder and VAEs**: at the released size (Qwen3-VL-32B truncated to the 51 layers read, 26.2 B; the video
  VAE 2.6 B; the audio VAE), random weights made on the device, where the planner's released plan says they fit
  beside the DiT on this GPU; otherwise the tiny ones of `--model` (the `gpu-accept` checkpoint), the text encoder
  first. The record says which ran at which size. With the tiny text encoder the DiT's text input is its width (the
  text embedding's first GEMM, once per request, not per forward).
- **Request**: T2VA at `--shape` (default 1344x768x124) on the schedule a Turbo-4 server pins (the LightX2V Turbo
  contract: 4 forwards, shifts 12 / 3); a merged adapter (`--merge-lora`) costs nothing per forward, and random
  adapter weights would time the same as random DiT weights.
- **Engine**: a `ModelRunner` over `--model` with these parts in place, warmed as `serve --warmup` warms it (the
  default schedule's AdaLN memo, one request at the shape), then one measured request: its stage timeline, each
  forward's time, the MFU of the full-depth forward against this run's GEMM peak, and the time outside the forwards.
- **Output**: the MP4 written with each video encoder this build has (x264 always; NVENC where `--video-encoder`
  exists and pynvvideocodec is installed), timed.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from h3serve.accel import attention
from h3serve.accel.compile import CompileState, compile_transformer
from h3serve.config.engine_config import EngineConfig
from h3serve.loading.tensors import materialize
from h3serve.media.mp4 import EncoderOptions, rgb8, write_mp4
from h3serve.media.nvenc import NvencMp4Writer, nvenc_missing
from h3serve.model.text_encoder import TextConditioner
from h3serve.model.transformer import H3Transformer, H3TransformerConfig, RotaryEmbedding3D
from h3serve.rank.device_checks import check_engine
from h3serve.rank.model_runner import ModelRunner
from h3serve.rank.warmup import warm_up
from h3serve.rules.adapter_choice import TurboContract, turbo_pin
from h3serve.rules.request import GenerationRequest
from h3serve.tools.bench.dit_forward import random_tensors
from h3serve.tools.bench.flops import FlopCounter
from h3serve.tools.bench.measure import gemm_peak
from h3serve.tools.bench.runners import h3_shape

RELEASED, TINY = "released", "tiny"
PARTS = ("text_encoder", "vae", "audio_vae")  # tried at the released size, the text encoder given up first
TURBO = TurboContract("minimax_h3_fl2v_turbo_4step_v1.0.safetensors", "fl2v", 4, "1.0", 12.0)
PROMPT = "A red fox trots through fresh snow at dawn, its paws crunching softly."


@dataclass(frozen=True)
class FullDepthSpec:
    model: Path  # the checkpoint whose tokenizer, processor config and tiny parts are used (gpu-accept)
    width: int = 1344
    height: int = 768
    num_frames: int = 124
    seed: int = 0
    gemm_seconds: float = 1.0
    out: Path | None = None


@dataclass
class FullDepthResult:
    sizes: dict[str, str]  # dit / text_encoder / vae / audio_vae -> released | tiny
    build_s: dict[str, float]
    warmup: dict[str, Any]
    stages: dict[str, float]
    timeline: Any
    forwards_s: list[float]
    flops_per_forward: float
    gemm_peak_flops: float
    e2e_s: float
    encoders: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @property
    def mfu(self) -> float:
        return self.flops_per_forward / min(self.forwards_s) / self.gemm_peak_flops

    @property
    def outside_forwards_s(self) -> float:
        return self.e2e_s - sum(self.forwards_s)

    def record(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "mfu": self.mfu, "outside_forwards_s": self.outside_forwards_s}


# ------------------------------------------------------------------------------------------------------------
# Which parts fit at the released size (the planner, no device needed)
PlanFromArgv = Callable[[list[str]], Any]  # `h3serve plan`'s flags -> its plan (the command passes it in)


def released_sizes(
    device_memory: int, width: int, height: int, num_frames: int, plan_from_argv: PlanFromArgv
) -> tuple[dict[str, str], Any]:
    """dit, text encoder and VAEs -> released | tiny: the released plan of a resident bf16 T2VA request at this
    shape on a device of `device_memory` bytes, with the text encoder, then each VAE, taken out (run tiny) until its
    peak plus headroom fits. Returns the sizes and the plan."""
    plan = plan_from_argv(["--preset", "released", "--task-type", "fl2va", "--task", "t2va", "--width", str(width),
                           "--height", str(height), "--duration", f"{num_frames / 24:.4f}", "--device", "cuda",
                           "--dtype", "bfloat16", "--device-memory", str(device_memory), "--adaln-memo", "off"])
    sizes = {"dit": RELEASED, **dict.fromkeys(PARTS, RELEASED)}
    rank = plan.ranks[0]
    for part in (None, *PARTS):
        if part is not None:
            sizes[part] = TINY
        dropped = [p for p in PARTS if sizes[p] == TINY]
        peak = max(s.device_bytes - sum(s.weights.get(p, 0) for p in dropped) for s in rank.stages)
        if peak + plan.headroom <= device_memory:
            return sizes, plan
    raise ValueError(f"the released DiT alone does not fit {device_memory / 2**30:.1f} GiB at {width}x{height}x"
                     f"{num_frames} (planned peak {rank.peak_device_bytes / 2**30:.1f} GiB without the other parts)")


# ------------------------------------------------------------------------------------------------------------
# Random parts on the device
def released_dit(device: torch.device, dtype: torch.dtype, text_dim: int, seed: int) -> H3Transformer:
    """The released DiT (text input `text_dim` wide) with random weights drawn on `device`, one tensor at a time."""
    cfg = dataclasses.replace(H3TransformerConfig(), text_dim=text_dim)
    with torch.device("meta"):
        model = H3Transformer(cfg)
    if device.type == "meta":  # the configuration alone (checked without a GPU)
        return model.eval()
    materialize(model, random_tensors(model, device, seed), dtype, device, H3Transformer.keep_in_fp32_modules)
    model.rope = RotaryEmbedding3D(cfg.rope_freq_dim, cfg.rope_theta).to(device)
    return model.eval()


def released_text_encoder(device: torch.device, dtype: torch.dtype, tokenizer) -> TextConditioner:
    """Qwen3-VL-32B as the engine loads it (the 51 decoder layers read), built on `device` in `dtype` with the
    library's own random initialisation; the tiny checkpoint's tokenizer (its ids are inside the vocabulary)."""
    from transformers import Qwen3VLModel

    from h3serve.offload.model_configs import released_configs

    config = released_configs(("transformer",)).text
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = Qwen3VLModel(config)
    finally:
        torch.set_default_dtype(previous)
    return TextConditioner(model.eval(), tokenizer)


def released_vaes(device: torch.device, dtype: torch.dtype) -> tuple[nn.Module, nn.Module]:
    """The released video VAE (in `dtype`, as the engine loads it) and audio VAE (fp32 by policy), built with their
    default (released) configs and random weights on `device`."""
    from diffusers import AutoencoderKLMiniMaxH3, AutoencoderKLMiniMaxH3Audio

    with torch.device(device):
        vae = AutoencoderKLMiniMaxH3().to(dtype).eval()
        audio = AutoencoderKLMiniMaxH3Audio(latents_mean=[0.0] * 32, latents_std=[1.0] * 32).eval()
    return vae, audio


# ------------------------------------------------------------------------------------------------------------
# The run
def _engine(
    spec: FullDepthSpec, plan_from_argv: PlanFromArgv, log: Callable[[str], None]
) -> tuple[ModelRunner, dict[str, str], dict[str, float]]:
    """A ModelRunner over `spec.model` with the full-depth DiT and the released parts that fit swapped in, pinned to
    the Turbo-4 schedule."""
    shape = f"{spec.width}x{spec.height}x{spec.num_frames}"
    config = EngineConfig(model=spec.model, device="cuda", dtype="bfloat16", task_type="fl2va", warmup=(shape,))
    engine = ModelRunner(config)
    device, dtype = engine.device, torch.bfloat16
    sizes, plan = released_sizes(torch.cuda.get_device_properties(device).total_memory, spec.width, spec.height,
                                 spec.num_frames, plan_from_argv)
    log(f"[full-depth] sizes: {sizes}")
    components, build = engine.pipeline.components, {}
    components.transformer = None  # the checkpoint's 2-block DiT goes before the full one is made (resident: the
    torch.cuda.empty_cache()  # offload runtime keeps no reference to it)
    start = time.perf_counter()
    if sizes["text_encoder"] == RELEASED:
        cache = components.text.cache
        components.text = released_text_encoder(device, dtype, components.text.tokenizer)
        components.text.cache = cache
        build["text_encoder"] = time.perf_counter() - start
    if sizes["vae"] == RELEASED:
        start = time.perf_counter()
        vae, audio = released_vaes(device, dtype)
        components.vae = vae
        if sizes["audio_vae"] == RELEASED:
            components.audio_vae = audio
        build["vaes"] = time.perf_counter() - start
    start = time.perf_counter()
    text_dim = components.text.model.config.text_config.hidden_size
    dit = released_dit(device, dtype, text_dim, spec.seed)
    dit.fuse_projections()
    attention.install(dit, check_engine(config).attention)
    for block in dit.transformer_blocks:  # the released plan's row chunk (the engine resolved the 2-block DiT's)
        block.row_chunk = plan.denoise_chunk_rows
    mode = engine.config.compile_mode(device.type)
    if mode is not None:
        compile_transformer(dit, mode, engine.config.compile_dynamic, CompileState(log=log),
                            backend=engine.config.compile_backend)
    components.transformer = dit
    build["dit"] = time.perf_counter() - start
    # A Turbo-4 server's defaults: the contract's schedule for every request (and for the warm-up's memo).
    engine.defaults = dataclasses.replace(engine.defaults, pinned_schedule=turbo_pin(TURBO, "turbo-4", "t2va"))
    return engine, sizes, build


def _encoders(out: Path, video, audio, device: torch.device) -> dict[str, Any]:
    """The output MP4 written by x264 (from host frames) and by NVENC (from the same uint8 frames on `device`),
    timed; an encoder this machine lacks is recorded with the reason."""
    results: dict[str, Any] = {}
    frames, height, width = video.shape[0], video.shape[1], video.shape[2]
    for name in ("x264", "nvenc"):
        path = out / f"full_depth-{name}.mp4"
        if name == "nvenc" and (missing := nvenc_missing(device)) is not None:
            results[name] = {"error": f"skipped: {missing}"}
            continue
        start = time.perf_counter()
        try:
            if name == "x264":
                write_mp4(path, video, audio, options=EncoderOptions(encoder="x264"))
            else:
                pixels = torch.from_numpy(rgb8(video)).to(device)
                with NvencMp4Writer(path, frames, height, width, audio, options=EncoderOptions(encoder="nvenc"),
                                    device=device) as writer:
                    writer.write(pixels)
        except Exception as e:  # an encoder that fails here: say why, time the other
            results[name] = {"error": f"{type(e).__name__}: {e}"}
            continue
        results[name] = {"seconds": time.perf_counter() - start, "bytes": path.stat().st_size}
    return results


def run_full_depth(
    spec: FullDepthSpec, plan_from_argv: PlanFromArgv, log: Callable[[str], None] = lambda line: None
) -> FullDepthResult:
    if not torch.cuda.is_available():
        raise ValueError("--full-depth runs the released DiT on one GPU; this machine has none")
    engine, sizes, build = _engine(spec, plan_from_argv, log)
    dit = engine.pipeline.components.transformer
    report = warm_up(engine, log)
    counter = FlopCounter()
    counter.attach(dit, dit.config, h3_shape)
    peak = gemm_peak(engine.device, torch.bfloat16, spec.gemm_seconds)
    request = GenerationRequest(prompt=PROMPT, width=spec.width, height=spec.height, num_frames=spec.num_frames,
                                seed=spec.seed + 1)
    plan = engine.plan(request)
    counter.reset()
    start = time.perf_counter()
    output = engine.generate(plan)
    e2e = time.perf_counter() - start
    per_forward = counter.flops / max(1, counter.forwards)
    notes = [f"{part} tiny: the released one does not fit beside the full-depth DiT on this GPU (planner)"
             for part in PARTS if sizes[part] == TINY]
    result = FullDepthResult(
        sizes={"dit": RELEASED, **{p: sizes[p] for p in PARTS}}, build_s=build,
        warmup={"seconds": report.seconds, "summary": report.summary()}, stages=dict(output.stage_durations),
        timeline=getattr(output, "stage_timeline", None), forwards_s=list(counter.forward_s),
        flops_per_forward=per_forward, gemm_peak_flops=peak["flops_per_s"],
        e2e_s=e2e, notes=notes,
    )
    if spec.out is not None:
        spec.out.mkdir(parents=True, exist_ok=True)
        if output.video is not None:
            result.encoders = _encoders(spec.out, output.video, output.audio, engine.device)
        (spec.out / "full_depth.json").write_text(json.dumps(result.record(), indent=1, default=str))
    return result
