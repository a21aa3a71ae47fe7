"""FP8 (float8_e4m3fn) linear layers: 1-byte weights with float32 scales, per output channel or per tensor.

Two kernel paths, chosen per engine at start-up (`select_kernel`):
  weight_only  the weight is dequantised into the compute dtype just before the GEMM (per layer, per call):
               any device, so CPU runs and tests it; exactly `F.linear(x, dequantize_fp8(w, s, dtype), bias)`,
               the weight being q · s in float32 rounded once to the compute dtype.
  fp8_gemm     dynamic per-call activation scales (per row with per-channel weights, one per call with a
               per-tensor weight), activations cast to FP8 and one `torch._scaled_mm` on FP8 tensor cores.
Both apply the float32 weight scales in float32: neither rounds a scale to the compute dtype.

`Fp8Linear` is a plain module (`in_features`, `out_features`, `weight`, `weight_scale`, `bias`, `forward(x)`), so
a LoRA wrapper can wrap it like an `nn.Linear`. The tensor-parallel variants live beside their `nn.Linear` twins
(h3serve.parallel.tensor_parallel): they keep this class's math and add the twin's collective, and each twin
builds its FP8 counterpart (`Fp8Twin`).

torchao 0.18's float8 configs store weights as tensor subclasses; the offload units (flat per-dtype buffers,
pinned copies, all-gathers), the sliced tensor-parallel reads and the fused Q/K/V concatenation all move plain
tensors, so the layers here hold plain FP8 tensors and call `torch._scaled_mm` themselves.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import nn

from h3serve.config.quantization_config import fp8_gemm_refusal

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
_TINY = torch.finfo(torch.float32).tiny  # an all-zero row still gets a usable (positive) scale
KERNEL_PATHS = ("weight_only", "fp8_gemm")


def weight_amax(weight: torch.Tensor, per_channel: bool) -> torch.Tensor:
    """|w| maxima in float32: [out, 1] per output channel, [1, 1] per tensor."""
    a = weight.detach().abs().float()
    return a.amax(dim=1, keepdim=True) if per_channel else a.amax().reshape(1, 1)


def scales_of(amax: torch.Tensor) -> torch.Tensor:
    """The scale that maps |x| <= amax onto e4m3's range: amax / 448 (float32)."""
    return (amax.float() / FP8_MAX).clamp_min(_TINY)


def quantize_fp8(
    weight: torch.Tensor, per_channel: bool = True, amax: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 weight, float32 scale [out, 1] or [1, 1]) with weight ≈ q · scale; round to nearest, saturating.

    `amax` overrides the maxima (a tensor-parallel shard uses the whole weight's, so shards equal slices of
    the one-rank quantisation)."""
    scale = scales_of(weight_amax(weight, per_channel) if amax is None else amax)
    q = (weight.detach().float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """q · scale computed in float32 and rounded once to `dtype`, the rule `fp8_gemm` follows too (its float32
    scales multiply the float32 accumulator). The e4m3 values are exact in bf16/fp16, so the one temporary is the
    result (2 bytes a weight in bf16, not a float32 copy): the in-place multiply by the float32 scale promotes
    each element to float32 and rounds on the store (rounding the scale to `dtype` first would round twice)."""
    return q.to(dtype).mul_(scale.float())


def scaled_mm_fits(in_features: int, out_features: int) -> bool:
    """`torch._scaled_mm` needs both GEMM dimensions of the weight to be multiples of 16."""
    return in_features % 16 == 0 and out_features % 16 == 0


def fp8_gemm(x: torch.Tensor, q: torch.Tensor, w_scale: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """x [..., K] (compute dtype) · (q · w_scale)ᵀ with activations quantised per call: per row against a
    per-channel weight, one scale for the call against a per-tensor weight."""
    rows = x.reshape(-1, x.shape[-1])
    rowwise = w_scale.shape[0] > 1
    amax = rows.abs().amax(dim=1, keepdim=True) if rowwise else rows.abs().amax().reshape(1, 1)
    # The multiplier in the activations' dtype (one temporary of their size, no float32 copy); the scale handed
    # to _scaled_mm is its exact reciprocal, so q·scale undoes precisely what was applied. An all-zero row gets
    # the dtype's largest finite multiplier (0·inf would be NaN).
    inv = (FP8_MAX / amax.float()).clamp_(max=torch.finfo(rows.dtype).max).to(rows.dtype)
    x_scale = inv.float().reciprocal()
    xq = (rows * inv).clamp_(-FP8_MAX, FP8_MAX).to(FP8)
    if rowwise:
        y = torch._scaled_mm(xq, q.t(), scale_a=x_scale, scale_b=w_scale.reshape(1, -1), out_dtype=out_dtype)
    else:
        y = torch._scaled_mm(xq, q.t(), scale_a=x_scale.reshape(()), scale_b=w_scale.reshape(()), out_dtype=out_dtype)
    return y.reshape(*x.shape[:-1], q.shape[0])


class Fp8Linear(nn.Module):
    """y = x·Wᵀ + b with W stored as e4m3 `weight` [out, in] and float32 `weight_scale` ([out, 1] or [1, 1])."""

    # A shard of input features whose output is summed over the ranks: its scales need the whole weight's maxima.
    sums_partials = False

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        per_channel: bool = True,
        compute_dtype: torch.dtype = torch.float32,
        kernel: str = "weight_only",
        device: torch.device | str | None = None,
    ):
        super().__init__()
        if kernel not in KERNEL_PATHS:
            raise ValueError(f"unknown FP8 kernel path {kernel!r}; choose from: {', '.join(KERNEL_PATHS)}")
        self.in_features, self.out_features = in_features, out_features
        self.compute_dtype = compute_dtype
        # A layer _scaled_mm cannot take (a dimension not a multiple of 16) keeps the weight-only path.
        self.kernel = kernel if scaled_mm_fits(in_features, out_features) else "weight_only"
        weight = torch.empty(out_features, in_features, dtype=FP8, device=device)
        self.weight = nn.Parameter(weight, requires_grad=False)
        rows = out_features if per_channel else 1
        self.register_buffer("weight_scale", torch.empty(rows, 1, dtype=torch.float32, device=device))
        self.bias = (
            nn.Parameter(torch.empty(out_features, dtype=compute_dtype, device=device), requires_grad=False)
            if bias
            else None
        )

    @property
    def per_channel(self) -> bool:
        return self.weight_scale.shape[0] > 1 or self.out_features == 1

    def dequantized_weight(self) -> torch.Tensor:
        return dequantize_fp8(self.weight, self.weight_scale, self.compute_dtype)

    def gemm(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x·Wᵀ (+ bias) on this layer's kernel path, in the compute dtype."""
        x = x.to(self.compute_dtype)
        if self.kernel == "fp8_gemm":
            y = fp8_gemm(x, self.weight, self.weight_scale, self.compute_dtype)
            return y if bias is None else y + bias
        return F.linear(x, self.dequantized_weight(), bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gemm(x, self.bias)

    def extra_repr(self) -> str:
        granularity = "per_channel" if self.per_channel else "per_tensor"
        return f"in_features={self.in_features}, out_features={self.out_features}, {granularity}, {self.kernel}"

    @classmethod
    def concat(cls, parts: list[Fp8Linear]) -> Fp8Linear:
        """One layer whose output rows are the parts' in order (the fused Q/K/V): exact, the weights and their
        scales are stacked (per-tensor scales become per-row, each row keeping its part's scale)."""
        first = parts[0]
        if any(type(p) is not type(first) or p.in_features != first.in_features for p in parts):
            raise ValueError("Fp8Linear.concat: parts must be the same kind of layer with the same input width")
        if any(p.bias is not None for p in parts):
            raise ValueError("Fp8Linear.concat: parts with biases are not fused")
        rows = sum(p.out_features for p in parts)
        with torch.device("meta"):
            fused = cls(first.in_features, rows, False, True, first.compute_dtype, first.kernel)
        fused.kernel = first.kernel if all(p.kernel == first.kernel for p in parts) else "weight_only"
        fused.weight = nn.Parameter(torch.cat([p.weight for p in parts]), requires_grad=False)
        scales = [p.weight_scale.expand(p.out_features, 1) for p in parts]
        fused.weight_scale = torch.cat(scales).contiguous()
        return fused


@runtime_checkable
class Fp8Twin(Protocol):
    """A linear that builds its own FP8 counterpart: the tensor-parallel linears, whose twins keep their
    collective (h3serve.parallel.tensor_parallel). Any other linear becomes a plain `Fp8Linear`."""

    def fp8_twin(
        self, per_channel: bool, compute_dtype: torch.dtype, kernel: str, device: torch.device | str
    ) -> Fp8Linear: ...


def select_kernel(requested: str, device: torch.device, compute_dtype: torch.dtype) -> tuple[str, str]:
    """(path, why) for `requested` ("auto" | "weight_only" | "fp8_gemm") on `device`. `ValueError` when
    fp8_gemm is asked for where it cannot run (the config refuses it earlier with the same reason)."""
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    refusal = fp8_gemm_refusal(device.type, capability)
    if refusal is None and compute_dtype not in (torch.bfloat16, torch.float16):
        refusal = f"the FP8 GEMM writes bf16/fp16 and the compute dtype is {compute_dtype}"
    if requested == "fp8_gemm" and refusal:
        raise ValueError(f"FP8 GEMM requested but {refusal}")
    if requested == "weight_only" or refusal:
        why = "as asked" if requested == "weight_only" else refusal
        return "weight_only", f"weight-only FP8: each layer's weight dequantised into {compute_dtype} before the " \
            f"GEMM ({why})"
    return "fp8_gemm", f"FP8 GEMM (torch._scaled_mm, dynamic per-call activation scales) on {device}"
