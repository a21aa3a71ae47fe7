"""FP8 linears: the e4m3 round trip, weight-only = "dequantise then GEMM" bit for bit, the FP8 GEMM path's
dynamic activation scales (torch._scaled_mm runs on CPU too), the fused Q/K/V, the kernel choice."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from h3serve.accel.fp8 import (
    FP8,
    FP8_MAX,
    Fp8Linear,
    dequantize_fp8,
    fp8_gemm,
    quantize_fp8,
    select_kernel,
)


def _weights(kind: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 96, generator=g) * 0.05
    if kind == "outliers":  # a few huge entries per row squeeze the rest towards e4m3's subnormals
        idx = torch.randint(0, 96, (64, 2), generator=g)
        w.scatter_(1, idx, torch.randn(64, 2, generator=g) * 40.0)
    return w


def _half_step(v: torch.Tensor) -> torch.Tensor:
    """Half the e4m3 spacing at |v| (in scaled units): 2^(e-3)/2 for normals (e >= -6), 2^-9/2 below."""
    exponent = torch.floor(torch.log2(v.abs().clamp_min(2.0**-6)))
    return torch.exp2(exponent - 3) / 2


@pytest.mark.parametrize("kind", ["random", "outliers"])
@pytest.mark.parametrize("per_channel", [True, False])
def test_round_trip_is_within_half_an_e4m3_step(kind, per_channel):
    w = _weights(kind)
    q, scale = quantize_fp8(w, per_channel)
    assert q.dtype == FP8 and scale.dtype == torch.float32
    assert scale.shape == ((64, 1) if per_channel else (1, 1))
    scaled = w / scale
    assert scaled.abs().max() <= FP8_MAX * (1 + 1e-6)  # amax maps onto 448: no saturation
    err = (dequantize_fp8(q, scale, torch.float32) - w).abs()
    bound = _half_step(scaled) * scale * (1 + 1e-5)
    assert bool((err <= bound).all()), float((err - bound).max())
    # The row maximum itself is exact (it lands on 448).
    rows = w.abs().amax(dim=1) if per_channel else w.abs().amax().reshape(1)
    deq_max = dequantize_fp8(q, scale, torch.float32).abs().amax(dim=1 if per_channel else None)
    torch.testing.assert_close(deq_max.reshape(-1)[: rows.numel()], rows, rtol=1e-6, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("per_channel", [True, False])
def test_weight_only_forward_is_dequantise_then_gemm_bit_for_bit(dtype, per_channel):
    w, b = _weights("outliers"), torch.randn(64)
    q, scale = quantize_fp8(w, per_channel)
    layer = Fp8Linear(96, 64, True, per_channel, dtype)
    layer.weight.data, layer.weight_scale, layer.bias.data = q, scale, b.to(dtype)
    x = torch.randn(3, 7, 96).to(dtype)
    expected = F.linear(x, (q.float() * scale).to(dtype), b.to(dtype))  # written out here, not shared
    assert torch.equal(layer(x), expected)


def _off_grid_scales(q: torch.Tensor) -> torch.Tensor:
    """Per-row float32 scales that bf16 cannot hold (8 significant bits): rounding them first would show."""
    rows = torch.arange(q.shape[0], dtype=torch.float32)[:, None]
    return (1.0 + rows * 2.0**-12 + 2.0**-20) * 2.0**-7


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_weight_scale_is_applied_in_float32_and_rounded_once(dtype):
    """Defect 8 of issue 29: the weight-only path rounded the float32 scale to bf16 before multiplying (two
    roundings; the GEMM path applies float32 scales). The dequantised weight is q · s in float32, rounded once."""
    q, _ = quantize_fp8(_weights("random"), True)
    scale = _off_grid_scales(q)
    assert not torch.equal(scale.to(dtype).float(), scale)  # the scales really are off the bf16/fp16 grid
    got = dequantize_fp8(q, scale, dtype)
    assert got.dtype == dtype
    assert torch.equal(got, (q.float() * scale).to(dtype))


@pytest.mark.parametrize("per_channel", [True, False])
def test_weight_only_and_fp8_gemm_agree_in_bf16_within_rounding(per_channel):
    """One rule for both kernel paths: activations that FP8 holds exactly (each row's maximum 448, so the
    activation scale is 1) leave the weight as the only difference, q · s in float32, which the weight-only path
    rounds once to bf16 and the GEMM path keeps in its float32 accumulator: the results agree within bf16's
    rounding of the result and of the weight."""
    g = torch.Generator().manual_seed(3)
    q, _ = quantize_fp8(_weights("random"), per_channel)
    scale = _off_grid_scales(q) if per_channel else torch.full((1, 1), 3.0e-4 + 2.0**-30)
    grid = torch.randn(6, 96, generator=g).mul(40).clamp(-FP8_MAX, FP8_MAX).to(FP8).float()
    grid[:, 0] = FP8_MAX
    x = grid.to(torch.bfloat16)
    weight_only = Fp8Linear(96, 64, False, per_channel, torch.bfloat16, "weight_only")
    weight_only.weight.data, weight_only.weight_scale = q, scale
    exact = grid.double() @ (q.double() * scale.double()).t()  # the product both paths approximate
    gemm = fp8_gemm(x, q, scale, torch.bfloat16).double()
    wo = weight_only(x).double()
    # bf16 keeps 8 significant bits: half an ulp of the output, plus the weight's rounding summed over |x|·|w|
    bound = exact.abs() * 2.0**-8 + (grid.abs().double() @ (q.double() * scale.double()).abs().t()) * 2.0**-9
    assert bool(((gemm - exact).abs() <= bound).all())
    assert bool(((wo - exact).abs() <= bound).all())


def test_fp8_gemm_quantises_activations_per_call():
    """The CUDA path's math, run by torch._scaled_mm on CPU: per-row activation scales against a per-channel
    weight, one scale per call against a per-tensor weight."""
    w = _weights("random")
    x = torch.randn(5, 96) * torch.linspace(0.1, 10, 5)[:, None]  # rows of very different ranges
    for per_channel in (True, False):
        q, scale = quantize_fp8(w, per_channel)
        amax = x.abs().amax(dim=1, keepdim=True) if per_channel else x.abs().amax().reshape(1, 1)
        multiplier = FP8_MAX / amax
        xq = (x * multiplier).clamp(-FP8_MAX, FP8_MAX).to(FP8)
        assert xq.float().abs().amax() == FP8_MAX  # each row's (or the call's) largest value lands on 448
        expected = (xq.float() / multiplier) @ (q.float() * scale).t()
        got = fp8_gemm(x, q, scale, torch.float32)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        # and it is an approximation of the full-precision product within FP8's error
        assert (got - x @ w.t()).abs().max() < 0.1 * (x @ w.t()).abs().max()


def test_fused_qkv_of_fp8_parts_is_exact():
    parts = []
    for i, per_channel in enumerate((False, True, False)):
        q, scale = quantize_fp8(torch.randn(32, 48) * (i + 1), per_channel)
        layer = Fp8Linear(48, 32, False, per_channel)
        layer.weight.data, layer.weight_scale = q, scale
        parts.append(layer)
    fused = Fp8Linear.concat(parts)
    x = torch.randn(4, 48)
    assert fused.weight_scale.shape == (96, 1)
    assert torch.equal(fused(x), torch.cat([p(x) for p in parts], dim=-1))


def test_kernel_choice_and_refusal_on_cpu():
    cpu = torch.device("cpu")
    path, why = select_kernel("auto", cpu, torch.float32)
    assert path == "weight_only" and "dequantised into torch.float32" in why and "no FP8 GEMM" in why
    with pytest.raises(ValueError, match="FP8 GEMM requested but the cpu device has no FP8 GEMM"):
        select_kernel("fp8_gemm", cpu, torch.bfloat16)
    # A layer _scaled_mm cannot take keeps the weight-only path.
    assert Fp8Linear(24, 48, False, kernel="fp8_gemm").kernel == "weight_only"
    assert Fp8Linear(32, 48, False, kernel="fp8_gemm").kernel == "fp8_gemm"


@pytest.mark.parametrize("per_channel", [True, False])
def test_fp8_gemm_in_bf16_handles_zero_rows(per_channel):
    w = _weights("random")
    q, scale = quantize_fp8(w, per_channel)
    x = torch.randn(6, 96).to(torch.bfloat16)
    x[2] = 0
    got = fp8_gemm(x, q, scale, torch.bfloat16).float()
    exact = x.float() @ w.t()
    assert torch.isfinite(got).all() and bool((got[2] == 0).all())
    assert (got - exact).abs().max() < 0.1 * exact.abs().max()
