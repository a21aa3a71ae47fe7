"""`h3serve bench --dit-forward`: one DiT forward, h3serve's variants against the diffusers reference, in one process.

At real sizes the DiT is nearly all of a request's time, and a full request adds VAE decoding and muxing whose
noise hides a few percent of step time. This mode times the forward alone:

- **Weights**: the DiT of a checkpoint (`--model`/`--preset`), or random weights at the released width with
  `--dit-layers N` blocks. Every model shares the same weight tensors (h3serve's fused Q/K/V
  projection is its own copy), so memory holds one set.
- **Inputs**: the T2VA packed layout of `--shape` (text rows from `--text-rows`), random rows, mid-denoise timesteps.
- **Variants**: `diffusers` (the reference, eager), and h3serve `eager` and `compiled` (regional, dynamic shapes)
  for each attention backend of `--attention-backend` (default TORCH_SDPA). With the engine option
  `quantization=` (fp8 | per_channel | per_tensor), each h3serve variant also runs in FP8 (`fp8 eager`,
  `fp8 compiled`): the same weights quantised as the loader does (the DiT's default module set), on the kernel
  path this device runs (the FP8 GEMM on CUDA with FP8 tensor cores, weight-only FP8 elsewhere; logged).
- **Memory**: each variant's own weight bytes, and (CUDA) the allocator peak of its forward above what was
  allocated before it (its working set); weights + working set is the peak of a process holding that variant
  alone.
- **Timing**: each variant's first call is reported on its own (for `compiled` it is the compile time), then
  `--runs` rounds, the variants in list order in even rounds and reversed in odd ones; medians, bests and the
  median of per-round ratios to the reference (the two forwards of a round ran back to back).
- **Fidelity**: max |difference| of each variant's video and audio outputs from the reference's.
- **FLOP/s**: analytic FLOPs of the forward (h3serve.tools.bench.flops; the text embedding excluded) over the
  best time, and its fraction of the best GEMM peak measured in the same run (before and after).
- **Profile**: one extra forward per variant under torch.profiler: attention / GEMM / other shares of self time.
  From the reference's profile, the **same-kernel floor**: the fraction of its forward spent in attention and GEMM
  kernels, about the least fraction of the reference's time an implementation calling the same kernels on the
  same shapes can take, whatever it removes around them.

h3serve embeds the text once per request (as its pipeline does), outside the timed forward; the reference embeds
it inside every forward (as its pipeline does): each side is timed as it runs in service.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from h3serve.accel import attention
from h3serve.accel.compile import CompileState, compile_transformer
from h3serve.accel.fp8 import select_kernel
from h3serve.accel.quantize import quantize_in_place
from h3serve.config.quantization_config import QuantizationConfig
from h3serve.loading.components import load_transformer
from h3serve.loading.tensors import materialize
from h3serve.model.layout import TEXT_TAG, build_keyframe_layout, patchify
from h3serve.model.transformer import H3Transformer, H3TransformerConfig, RotaryEmbedding3D
from h3serve.rules import geometry, limits
from h3serve.tools.bench.flops import ForwardShape, forward_flops
from h3serve.tools.bench.measure import gemm_peak, sync
from h3serve.tools.bench.profiling import op_table

REFERENCE = "diffusers"
MODES = ("eager", "compiled")


@dataclass(frozen=True)
class DitBenchSpec:
    width: int
    height: int
    num_frames: int
    text_rows: int
    device: torch.device
    dtype: torch.dtype
    model: Path | None  # a checkpoint folder; None: random weights of `random_config`
    random_config: H3TransformerConfig | None = None  # e.g. the released width with a few blocks
    modes: tuple[str, ...] = MODES
    backends: tuple[str, ...] = ("TORCH_SDPA",)
    warmup: int = 1
    runs: int = 5
    profile: bool = True
    seed: int = 0
    gemm_seconds: float = 3.0  # budget of each GEMM peak measurement (before and after the rounds)
    quantization: QuantizationConfig | None = None  # FP8 variants beside the full-precision ones


@dataclass
class VariantResult:
    name: str
    first_call_s: float
    times: list[float] = field(default_factory=list)
    max_diff_video: float = 0.0
    max_diff_audio: float = 0.0
    profile: dict[str, Any] | None = None
    peak_device_mb: float | None = None
    weight_mb: float = 0.0  # this variant's own parameters and buffers
    forward_peak_mb: float | None = None  # CUDA: allocator peak of a forward above what was allocated before it


@dataclass(frozen=True)
class DitBenchResult:
    spec: DitBenchSpec
    config: H3TransformerConfig
    shape: ForwardShape
    flops: float
    gemm_peak_flops: float
    variants: list[VariantResult]

    def result(self, name: str) -> VariantResult:
        return next(v for v in self.variants if v.name == name)


# ---------------------------------------------------------------------------------------------------------------
# Models: one set of weights, several modules over it
# ---------------------------------------------------------------------------------------------------------------


def random_tensors(model: nn.Module, device: torch.device, seed: int) -> Iterator[tuple[str, torch.Tensor]]:
    """N(0, 1/fan_in) weights (activations keep their scale through the blocks), zero biases, unit norms."""
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, p in model.state_dict().items():
        if name.endswith("bias"):
            yield name, torch.zeros(p.shape, device=device)
        elif p.dim() == 1:
            yield name, torch.ones(p.shape, device=device)
        else:
            yield name, torch.randn(p.shape, device=device, generator=gen) / p.shape[-1] ** 0.5


def _ours(cfg: H3TransformerConfig, weights: dict[str, torch.Tensor], device: torch.device) -> H3Transformer:
    """An H3Transformer over `weights` (assigned, not copied), its Q/K/V fused as the engine does."""
    with torch.device("meta"):
        model = H3Transformer(cfg)
    model.load_state_dict(weights, strict=True, assign=True)
    model.rope = RotaryEmbedding3D(cfg.rope_freq_dim, cfg.rope_theta).to(device)
    model.fuse_projections()
    return model.eval()


def _fp8(
    cfg: H3TransformerConfig, weights: dict[str, torch.Tensor], spec: DitBenchSpec, log: Callable[[str], None]
) -> H3Transformer:
    """`_ours` with the DiT's selected linears quantised to FP8 before the Q/K/V fusion (as the loader does)."""
    quant = spec.quantization.component("transformer") if spec.quantization else None
    if quant is None:
        raise ValueError("quantization: the DiT (dit) is not quantised by this config")
    kernel, why = select_kernel(spec.quantization.kernel, spec.device, spec.dtype)
    log(f"[dit-forward] fp8: {spec.quantization.describe()}; kernel: {why}")
    with torch.device("meta"):
        model = H3Transformer(cfg)
    model.load_state_dict(weights, strict=True, assign=True)
    model.rope = RotaryEmbedding3D(cfg.rope_freq_dim, cfg.rope_theta).to(spec.device)
    quantize_in_place(model, "transformer", quant, spec.dtype, kernel)
    model.fuse_projections()
    return model.eval()


def _module_mb(model: nn.Module) -> float:
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()]) / 2**20


def _reference(cfg: H3TransformerConfig, weights: dict[str, torch.Tensor], device: torch.device) -> nn.Module:
    from diffusers import MiniMaxH3Transformer3DModel
    from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3RotaryPosEmbed

    with torch.device("meta"):
        model = MiniMaxH3Transformer3DModel(**{k: getattr(cfg, k) for k in cfg.__dataclass_fields__})
    model.load_state_dict(weights, strict=True, assign=True)
    model.rope = MiniMaxH3RotaryPosEmbed(cfg.rope_freq_dim, cfg.rope_theta).to(device)
    return model.eval()


def load_weights(spec: DitBenchSpec) -> tuple[H3TransformerConfig, dict[str, torch.Tensor]]:
    """The DiT config and its weights (diffusers key names, the h3serve dtype policy) on the device."""
    if spec.model is not None:
        model = load_transformer(spec.model / "transformer", spec.dtype, spec.device)
        return model.config, dict(model.state_dict())
    cfg = spec.random_config or H3TransformerConfig(num_layers=4)
    with torch.device("meta"):
        model = H3Transformer(cfg)
    materialize(
        model,
        random_tensors(model, spec.device, spec.seed),
        spec.dtype,
        spec.device,
        H3Transformer.keep_in_fp32_modules,
    )
    return cfg, dict(model.state_dict())


# ---------------------------------------------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ForwardInputs:
    video: torch.Tensor
    audio: torch.Tensor
    text: torch.Tensor  # text encoder states [1, L, text_dim]
    timestep: torch.Tensor
    row_index: torch.Tensor
    packed: Any  # PackedLayout

    @property
    def shape(self) -> ForwardShape:
        return ForwardShape(self.video.shape[1], self.audio.shape[1], self.text.shape[1], self.timestep.numel())


def forward_inputs(cfg: H3TransformerConfig, spec: DitBenchSpec) -> ForwardInputs:
    """The T2VA rows of one request of the spec's shape, at the middle of denoising."""
    frames = geometry.latent_frames(spec.num_frames)
    lh, lw = geometry.latent_edge(spec.height), geometry.latent_edge(spec.width)
    audio_latents = geometry.audio_latents(spec.num_frames)
    layout = build_keyframe_layout(torch.full((spec.text_rows,), TEXT_TAG), frames, lh, lw, audio_latents)
    gen = torch.Generator().manual_seed(spec.seed + 1)
    video = patchify(torch.randn(1, cfg.in_channels, frames, lh, lw, generator=gen))[None]
    audio = torch.randn(1, limits.AUDIO_CHANNELS * audio_latents, cfg.audio_in_channels, generator=gen)
    text = torch.randn(1, spec.text_rows, cfg.text_dim, generator=gen)
    timestep, row_index = layout.row_timesteps(0.5, 0.5)
    packed = layout.packed.to(spec.device)
    return ForwardInputs(
        video.to(spec.device),
        audio.to(spec.device),
        text.to(spec.device, spec.dtype),
        timestep.to(spec.device),
        row_index.to(spec.device),
        packed,
    )


def _reference_call(model: nn.Module, x: ForwardInputs) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
    p = x.packed
    return lambda: model(
        hidden_states=x.video,
        audio_hidden_states=x.audio,
        encoder_hidden_states=x.text,
        timestep=x.timestep,
        timestep_indices=x.row_index,
        token_tags=p.token_tags,
        position_ids=p.position_ids,
        video_indices=p.video_indices,
        audio_indices=p.audio_indices,
        text_indices=p.text_indices,
        return_dict=False,
    )


def _our_call(model: H3Transformer, x: ForwardInputs) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
    text = model.embed_text(x.text)  # once per request, as in the pipeline
    return lambda: model(x.video, x.audio, text, x.timestep, x.row_index, x.packed)


# ---------------------------------------------------------------------------------------------------------------
# Measurement
# ---------------------------------------------------------------------------------------------------------------


def _timed(fn: Callable[[], Any], device: torch.device) -> tuple[float, Any]:
    sync(device)
    start = time.perf_counter()
    out = fn()
    sync(device)
    return time.perf_counter() - start, out


def run_dit_bench(spec: DitBenchSpec, log: Callable[[str], None]) -> DitBenchResult:
    """Build the variants over one set of weights, time them alternated, compare outputs, profile once each."""
    for backend in spec.backends:
        attention.check_backend(backend, spec.device)
    cfg, weights = load_weights(spec)
    x = forward_inputs(cfg, spec)
    calls: dict[str, Callable[[], tuple[torch.Tensor, torch.Tensor]]] = {}
    sizes: dict[str, float] = {}
    with torch.no_grad():
        reference = _reference(cfg, weights, spec.device)
        calls[REFERENCE], sizes[REFERENCE] = _reference_call(reference, x), _module_mb(reference)
        kinds = ("", "fp8 ") if spec.quantization is not None else ("",)
        for kind in kinds:
            for backend in spec.backends:
                for mode in spec.modes:
                    model = _fp8(cfg, weights, spec, log) if kind else _ours(cfg, weights, spec.device)
                    attention.install(model, dict.fromkeys(attention.ROLES, backend))
                    if mode == "compiled":
                        compile_transformer(model, "regional", True, CompileState(log=log))
                    name = f"{kind}{mode}" + ("" if len(spec.backends) == 1 else f" {backend}")
                    calls[name], sizes[name] = _our_call(model, x), _module_mb(model)
        del weights
        peak_before = gemm_peak(spec.device, spec.dtype, spec.gemm_seconds)["flops_per_s"]
        results, reference_out = {}, None
        for name, call in calls.items():  # first calls: compile happens here
            seconds, out = _timed(call, spec.device)
            log(f"[dit-forward] {name}: first call {seconds:.3f} s")
            results[name] = VariantResult(name, seconds, weight_mb=sizes[name])
            if name == REFERENCE:
                reference_out = out
            else:
                results[name].max_diff_video = (out[0].float() - reference_out[0].float()).abs().max().item()
                results[name].max_diff_audio = (out[1].float() - reference_out[1].float()).abs().max().item()
        for _ in range(spec.warmup):
            for call in calls.values():
                call()
        names = list(calls)
        for i in range(spec.runs):
            for name in names if i % 2 == 0 else names[::-1]:
                if spec.device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(spec.device)
                    before = torch.cuda.memory_allocated(spec.device)
                seconds, _ = _timed(calls[name], spec.device)
                results[name].times.append(seconds)
                if spec.device.type == "cuda":
                    peak = torch.cuda.max_memory_allocated(spec.device)
                    results[name].peak_device_mb = peak / 2**20
                    results[name].forward_peak_mb = (peak - before) / 2**20
            log(f"[dit-forward] round {i}: " + ", ".join(f"{n} {results[n].times[-1]:.3f} s" for n in names))
        peak = max(peak_before, gemm_peak(spec.device, spec.dtype, spec.gemm_seconds)["flops_per_s"])
        if spec.profile:
            from torch.profiler import ProfilerActivity, profile

            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if spec.device.type == "cuda" else [])
            for name, call in calls.items():
                with profile(activities=activities) as prof:
                    call()
                    sync(spec.device)
                results[name].profile = op_table(prof.key_averages(), spec.device, top=6)
    return DitBenchResult(spec, cfg, x.shape, forward_flops(cfg, x.shape), peak, [results[n] for n in names])


# ---------------------------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------------------------


def same_kernel_floor(profile: dict[str, Any] | None) -> float | None:
    """Attention + GEMM share of a profiled forward: the least time (as a fraction) at the same kernels."""
    if not profile:
        return None
    return profile["shares"]["attention"] + profile["shares"]["gemm"]


def summary(result: DitBenchResult) -> str:
    """A Markdown table: one row per variant, ratios against the reference."""
    spec, ref = result.spec, result.result(REFERENCE)
    cfg = result.config
    weights = (
        f"checkpoint {spec.model.name}"
        if spec.model
        else (
            f"random weights, {cfg.num_layers} blocks of hidden {cfg.hidden_size} ({cfg.num_attention_heads} heads of "
            f"{cfg.attention_head_dim}), FFN {cfg.ffn_dim}"
        )
    )
    lines = [
        f"DiT forward, {spec.width}x{spec.height}x{spec.num_frames} ({result.shape.seq_len} rows: "
        f"{result.shape.video_rows} video, {result.shape.audio_rows} audio, {result.shape.text_rows} text), "
        f"{weights}, {spec.device.type} {str(spec.dtype).removeprefix('torch.')}; {spec.runs} alternated rounds "
        f"after {spec.warmup} warm-up; {result.flops / 1e9:.1f} GFLOP per forward; same-run GEMM peak "
        f"{result.gemm_peak_flops / 1e9:.0f} GFLOP/s",
        "",
        "| variant | first call s | median s | best s | / reference: medians | best | paired median | "
        "GFLOP/s (best) | of GEMM peak | max diff video / audio | attention / GEMM / other | FP8 GEMM | "
        "weights MB | forward peak MB | peak device MB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for v in result.variants:
        med, best = statistics.median(v.times), min(v.times)
        paired = statistics.median(a / b for a, b in zip(v.times, ref.times, strict=True))
        shares = (
            " / ".join(f"{100 * v.profile['shares'][c]:.1f}%" for c in ("attention", "gemm", "other"))
            if v.profile
            else "–"
        )
        diff = "–" if v is ref else f"{v.max_diff_video:.2e} / {v.max_diff_audio:.2e}"
        device_mb = "–" if v.peak_device_mb is None else f"{v.peak_device_mb:.0f}"
        forward_mb = "–" if v.forward_peak_mb is None else f"{v.forward_peak_mb:.0f}"
        fp8_share = f"{100 * v.profile['fp8_gemm']:.1f}%" if v.profile and "fp8 " in f"{v.name} " else "–"
        flops = result.flops / best
        lines.append(
            f"| {v.name} | {v.first_call_s:.3f} | {med:.3f} | {best:.3f} | {med / statistics.median(ref.times):.3f} "
            f"| {best / min(ref.times):.3f} | {paired:.3f} | {flops / 1e9:.1f} | "
            f"{100 * flops / result.gemm_peak_flops:.1f}% | {diff} | {shares} | {fp8_share} | {v.weight_mb:.0f} | "
            f"{forward_mb} | {device_mb} |"
        )
    floor = same_kernel_floor(ref.profile)
    if floor is not None:
        lines += [
            "",
            f"Same-kernel floor: the reference spends {100 * floor:.1f}% of its forward's self time in "
            f"attention and GEMM kernels; an implementation calling the same kernels on the same shapes, with "
            f"everything around them removed, would take about {floor:.3f}x the reference's time.",
        ]
    return "\n".join(lines) + "\n"
