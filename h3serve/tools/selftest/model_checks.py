"""Checks on a few-block DiT with random weights (the released width on CUDA, a reduced one on CPU): numerics,
attention kernels, compile, the offload memory paths, and throughput. Nothing is downloaded."""

from __future__ import annotations

import gc
import statistics
import time

import torch

from h3serve.accel import attention
from h3serve.model.transformer import H3Transformer
from h3serve.offload.host_arena import pinned_bytes
from h3serve.offload.runtime import _BlockStream, share_slots, streamed_blocks
from h3serve.offload.units import HostUnit
from h3serve.rules import limits
from h3serve.tools.bench.dit_forward import DitBenchSpec, _ours, forward_inputs, load_weights
from h3serve.tools.bench.flops import forward_flops
from h3serve.tools.bench.measure import gemm_peak, sync
from h3serve.tools.selftest.core import CheckFailed, SelftestContext, Skip
from h3serve.tools.selftest.plan_verdict import layerwise_stage

# Relative RMS error bounds (stated in the figure): a 3-block bf16 forward against fp32 on the same weights sits
# near 1e-2; attention kernels in bf16 near 4e-3 of the output scale; fp32 paths agree to float rounding.
HALF_BOUND, FP32_BOUND = 5e-2, 1e-4
PEAK_MARGIN = 0.10  # allowed excess of the allocator's peak over the predicted one (allocator rounding, workspaces)


def _bound(dtype: torch.dtype) -> float:
    return FP32_BOUND if dtype == torch.float32 else HALF_BOUND


def rel_error(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def _spec(ctx: SelftestContext, dtype: torch.dtype, shape: tuple[int, int, int], text_rows: int = 64) -> DitBenchSpec:
    width, height, frames = shape
    return DitBenchSpec(width, height, frames, text_rows, ctx.device, dtype, None, random_config=ctx.dit)


def _model(ctx: SelftestContext, dtype: torch.dtype) -> tuple[H3Transformer, dict]:
    cfg, weights = load_weights(_spec(ctx, dtype, ctx.numerics_shape()))
    model = _ours(cfg, weights, ctx.device)
    attention.install(model, ctx.attention)
    return model, weights


def run_forward(model: H3Transformer, x) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        return model(x.video, x.audio, model.embed_text(x.text), x.timestep, x.row_index, x.packed)


def block_dtype(ctx: SelftestContext) -> str:
    """The few-block DiT in the compute dtype against itself in fp32 (same random weights, same inputs)."""
    if ctx.dtype == torch.float32:
        raise Skip("the compute dtype is float32: there is no lower precision to compare with fp32")
    low, _ = _model(ctx, ctx.dtype)
    wide, _ = _model(ctx, torch.float32)
    x = forward_inputs(low.config, _spec(ctx, ctx.dtype, ctx.numerics_shape()))
    xw = forward_inputs(wide.config, _spec(ctx, torch.float32, ctx.numerics_shape()))
    errs = [rel_error(a, b) for a, b in zip(run_forward(low, x), run_forward(wide, xw), strict=True)]
    figure = f"rel. RMS error video {errs[0]:.1e}, audio {errs[1]:.1e} (bound {HALF_BOUND:.0e})"
    if max(errs) > HALF_BOUND:
        raise CheckFailed(f"{figure}: the {ctx.dtype} DiT drifts from fp32; check the dtype policy / kernels")
    return figure


def _reference_attention(q, k, v) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention by its formula in fp32: [B, S, H, D] -> ([B, S, H, D], lse [B, H, S])."""
    qh, kh, vh = (t.transpose(1, 2).float() for t in (q, k, v))
    scores = (qh @ kh.transpose(-1, -2)) * q.shape[-1] ** -0.5
    lse = torch.logsumexp(scores, -1)
    return (torch.softmax(scores, -1) @ vh).transpose(1, 2), lse


def attention_backend(name: str):
    """A check of one attention backend (whole and, if it has one, its log-sum-exp form) against the formula."""

    def check(ctx: SelftestContext) -> str:
        backend = attention.BACKENDS[name]
        reason = backend.unusable(ctx.device)
        if reason is not None:
            raise Skip(f"{name} {reason}")
        dtype = ctx.dtype if ctx.dtype in attention.HALF_DTYPES or not backend.half_only else torch.bfloat16
        heads, dim, rows = (ctx.dit.num_attention_heads, ctx.dit.attention_head_dim, 4096 if ctx.cuda else 256)
        g = torch.Generator(device=ctx.device).manual_seed(3)
        q, k, v = (torch.randn(1, rows, heads, dim, device=ctx.device, generator=g).to(dtype) for _ in range(3))
        want, want_lse = _reference_attention(q, k, v)
        err = rel_error(backend.fn(q, k, v), want)
        lse_err = 0.0
        if backend.with_lse is not None:
            out, lse = backend.with_lse(*(t.transpose(1, 2) for t in (q, k, v)))
            err = max(err, rel_error(out.transpose(1, 2), want))
            lse_err = float((lse.float() - want_lse).abs().max())
        bound = _bound(dtype)
        figure = f"{dtype}: rel. error {err:.1e}, max |lse error| {lse_err:.1e} (bound {bound:.0e})"
        if err > bound or lse_err > 100 * bound:
            raise CheckFailed(f"{figure}: {name} disagrees with softmax attention; use TORCH_SDPA")
        return figure

    return check


def row_chunks(ctx: SelftestContext) -> str:
    """The few-block DiT with its working set in row chunks (`--denoise-chunk-rows`) against whole rows: the same
    per-row math, bit-identical on CPU; on a GPU within rounding (cuBLAS may tile fewer rows differently), and the
    allocator's peak lower."""
    model, _ = _model(ctx, ctx.dtype)
    x = forward_inputs(model.config, _spec(ctx, ctx.dtype, ctx.numerics_shape()))
    rows = x.packed.seq_len
    results, peaks = [], []
    for chunk in (None, -(-rows // 3)):  # three chunks
        for block in model.transformer_blocks:
            block.row_chunk = chunk
        if ctx.cuda:
            sync(ctx.device)
            torch.cuda.reset_peak_memory_stats(ctx.device)
            base = torch.cuda.memory_allocated(ctx.device)
        results.append(run_forward(model, x))
        if ctx.cuda:
            peaks.append((torch.cuda.max_memory_allocated(ctx.device) - base) / 2**20)
    errs = [rel_error(a, b) for a, b in zip(results[1], results[0], strict=True)]
    figure = f"{rows} rows in chunks of {chunk}: rel. error {max(errs):.1e}"
    if peaks:
        figure += f", forward peak {peaks[0]:.0f} -> {peaks[1]:.0f} MiB"
    if not ctx.cuda and not all(torch.equal(a, b) for a, b in zip(*results, strict=True)):
        raise CheckFailed(f"{figure}: chunked rows differ on CPU, where they must be bit-identical")
    if max(errs) > _bound(ctx.dtype) / 10:
        raise CheckFailed(f"{figure} (bound {_bound(ctx.dtype) / 10:.0e}): chunking changed the math; use "
                     "--denoise-chunk-rows off and report it")
    return figure


def compiled(ctx: SelftestContext) -> str:
    if not ctx.cuda:
        raise Skip("compile is checked on CUDA (the engine compiles there by default; on CPU the C++ build alone "
                   "exceeds the budget)")
    if not ctx.compile:
        raise Skip("the engine flags run eager (--enforce-eager)")
    from h3serve.accel.compile import CompileState, compile_transformer

    model, weights = _model(ctx, ctx.dtype)
    x = forward_inputs(model.config, _spec(ctx, ctx.dtype, ctx.numerics_shape()))
    eager = run_forward(model, x)
    compile_transformer(model, "regional", True, CompileState(log=lambda text: None))
    start = time.perf_counter()
    got = run_forward(model, x)
    sync(ctx.device)
    errs = [rel_error(a, b) for a, b in zip(got, eager, strict=True)]
    first_s = time.perf_counter() - start
    figure = f"rel. error {max(errs):.1e} (bound {_bound(ctx.dtype):.0e}), first compiled call {first_s:.0f} s"
    if max(errs) > _bound(ctx.dtype):
        raise CheckFailed(f"{figure}: the compiled DiT disagrees with eager; run with --enforce-eager and report it")
    return figure


def _streamed(model: H3Transformer, device: torch.device, resident: int) -> tuple[list[HostUnit], list[HostUnit]]:
    """Layerwise offload of `model` as the runtime lays it out: non-block weights resident, the first `resident`
    DiT blocks resident, the others streamed through two slots (a side copy stream on CUDA). Returns (kept,
    streamed) units, nothing on the device yet (`_place` puts them there)."""
    copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
    groups = streamed_blocks("transformer", model)
    every = tuple(b for blocks in groups.values() for b in blocks)
    kept = [HostUnit(model, "transformer", "resident", device, lambda *_: None, skip=every)]
    streamed: list[HostUnit] = []
    for path, blocks in groups.items():
        keep = resident if path == "transformer_blocks" else 0
        kept += [HostUnit(block, "transformer", "resident", device, lambda *_: None) for block in blocks[:keep]]
        units = [HostUnit(b, "transformer", "stream", device, lambda *_: None) for b in blocks[keep:]]
        if units:
            _BlockStream(blocks[keep:], units, copy_stream, 0 if path == "transformer_blocks" else None)
        streamed += units
    return kept, streamed


def _place(kept: list[HostUnit], streamed: list[HostUnit], device: torch.device) -> None:
    for unit in kept:
        unit.load()
    if device.type == "cuda" and streamed:
        share_slots(streamed, device)


def _allocated(device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    gc.collect()  # the hooks of a dropped path form reference cycles: free its device memory now
    torch.cuda.synchronize(device)
    return torch.cuda.memory_allocated(device)


def memory_paths(ctx: SelftestContext) -> tuple[str, dict]:
    """CPU offload (the whole DiT staged), layerwise offload and a resident-layers prefix give the resident
    output bit for bit; on CUDA pinned bytes are exact and the layerwise allocator peak, with that DiT alone on
    the device, is within the planner's figure for it (`h3serve plan`'s denoise tensors) + PEAK_MARGIN."""
    host = torch.device("cpu")
    spec = _spec(ctx, ctx.dtype, ctx.numerics_shape())
    cfg, weights = load_weights(spec)
    # Master weights in host memory: each path copies what it places, so the device holds one path at a time.
    weights = {k: v.to(host) for k, v in weights.items()}
    x = forward_inputs(cfg, spec)

    def fresh(device: torch.device = host) -> H3Transformer:
        model = _ours(cfg, {k: v.to(device) for k, v in weights.items()}, ctx.device)
        attention.install(model, ctx.attention)
        return model

    resident_model = fresh(ctx.device)
    resident = run_forward(resident_model, x)
    del resident_model
    data: dict = {}
    pinned_before = pinned_bytes()
    staged = fresh()
    paths = {"cpu_offload": (staged, [HostUnit(staged, "transformer", "resident", ctx.device, lambda *_: None)], [])}
    for name, keep in (("layerwise", 0), ("resident_prefix", 1)):
        model = fresh()
        paths[name] = (model, *_streamed(model, ctx.device, keep))
    if ctx.cuda:  # every unit pins one arena of exactly its bytes: the planner's host figure is the real one
        pinned = pinned_bytes() - pinned_before
        planned = sum(u.host_bytes for _, kept, streamed in paths.values() for u in kept + streamed)
        data["pinned"] = {"bytes": pinned, "planned": planned}
        if pinned != planned:
            raise CheckFailed(f"pinned host memory {pinned} B differs from the units' (the plan's) {planned} B")
    stage = layerwise_stage(cfg, ctx.dtype, ctx.numerics_shape(), spec.text_rows, ctx.device.type)
    for name in list(paths):
        model, kept, streamed = paths.pop(name)  # dropped after its forward: one path on the device at a time
        base = _allocated(ctx.device)
        if ctx.cuda:
            torch.cuda.reset_peak_memory_stats(ctx.device)
        _place(kept, streamed, ctx.device)
        try:
            got = run_forward(model, x)
        except RuntimeError as e:  # a block computed on released (empty) weights: a hook did not place it
            raise CheckFailed(f"{name}: the forward failed under offload, a block was not on the device ({e})") \
                from None
        if not all(torch.equal(a, b) for a, b in zip(got, resident, strict=True)):
            diff = max(float((a.float() - b.float()).abs().max()) for a, b in zip(got, resident, strict=True))
            raise CheckFailed(f"{name}: output differs from resident (max |diff| {diff:.2e}); offload hooks are wrong")
        data[name] = {"host_bytes": sum(u.host_bytes for u in kept + streamed)}
        if name == "layerwise":
            data[name]["predicted"] = stage.tensor_bytes
        if ctx.cuda and name == "layerwise":
            peak = torch.cuda.max_memory_allocated(ctx.device) - base
            data[name]["peak"] = peak
            if peak > stage.tensor_bytes * (1 + PEAK_MARGIN):
                raise CheckFailed(f"layerwise: allocator peak {peak / 2**20:.0f} MiB exceeds the plan's "
                             f"{stage.tensor_bytes / 2**20:.0f} MiB by more than {PEAK_MARGIN:.0%}: streamed "
                             "blocks pile up or the planner's denoise activations are low")
        for unit in kept + streamed:
            unit.release()
        del model, kept, streamed, got
    figure = "cpu offload, layerwise, resident prefix: bit-identical to resident"
    if ctx.cuda:
        lw = data["layerwise"]
        figure += f"; layerwise peak {lw['peak'] / 2**20:.0f} MiB vs planned {lw['predicted'] / 2**20:.0f} MiB " \
                  f"(margin {PEAK_MARGIN:.0%})"
    return figure, data


def throughput(ctx: SelftestContext) -> tuple[str, dict]:
    """Step time and MFU of the few-block DiT at the released default canvas (1344x768, 124 frames on CUDA),
    extrapolated to the 50-block DiT and a 50-step request (50 forwards)."""
    spec = _spec(ctx, ctx.dtype, ctx.shape(), text_rows=256)
    cfg, weights = load_weights(spec)
    model = _ours(cfg, weights, ctx.device)
    attention.install(model, ctx.attention)
    x = forward_inputs(cfg, spec)
    run_forward(model, x)  # warm-up
    times = []
    for _ in range(3):
        sync(ctx.device)
        start = time.perf_counter()
        run_forward(model, x)
        sync(ctx.device)
        times.append(time.perf_counter() - start)
    step = statistics.median(times)
    flops = forward_flops(cfg, x.shape)
    # MFU against the GEMM peak measured here; at the CPU's reduced width it would say nothing (and cost seconds).
    peak = gemm_peak(ctx.device, ctx.dtype, budget_s=1.0)["flops_per_s"] if ctx.cuda else None
    mfu = f"MFU {flops / step / peak:.0%} of the measured GEMM peak" if peak else "MFU not measured at this width"
    full_step = step * 50 / cfg.num_layers  # the non-block share is counted 50/L times: an upper bound
    request = full_step * limits.DEFAULT_STEPS
    w, h, f = ctx.shape()
    figure = (f"{cfg.num_layers} blocks at {w}x{h}x{f}: {step * 1e3:.0f} ms/forward, {mfu}; "
              f"50 blocks: ~{full_step:.2f} s/step, 50 steps: ~{request:.0f} s")
    data = {"forward_s": step, "flops": flops, "gemm_peak": peak, "full_step_s": full_step, "request_s": request}
    if ctx.cuda and ctx.released_plan is not None:
        from h3serve.tools.selftest.plan_verdict import released_verdict

        verdict, plan = released_verdict(ctx.device, ctx.released_plan)
        figure += f"; planner: {verdict}"
        data["plan"] = plan
    return figure, data
