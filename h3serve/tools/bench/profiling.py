"""`--profile`: one extra run under torch.profiler, a trace file and a top-ops table with category shares.

Shares use each op's *self* time (device time on GPU, CPU time otherwise), so nested ops are never counted twice.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

CATEGORIES = ("attention", "gemm", "communication", "other")
_ATTENTION = ("attention", "sdpa", "flash", "softmax")
_GEMM = (
    "aten::mm",
    "aten::addmm",
    "aten::bmm",
    "aten::baddbmm",
    "aten::matmul",
    "aten::linear",
    "aten::_mm",
    "aten::_scaled_mm",
    "mkldnn_linear",
    "mkl_linear",
    "gemm",
    "cublas",
    "cutlass",
)
_FP8_GEMM = ("scaled_mm", "e4m3", "fp8")  # torch._scaled_mm and the FP8 kernels under it (cuBLASLt, CUTLASS)
_COMMUNICATION = ("c10d::", "nccl", "gloo:", "record_param_comms")  # collectives, their kernels and wrappers


def category(op_name: str) -> str:
    """Which share an op's self time goes to (attention is matched first: its kernels contain GEMMs)."""
    name = op_name.lower()
    if any(k in name for k in _ATTENTION):
        return "attention"
    if any(k in name for k in _GEMM):
        return "gemm"
    if any(k in name for k in _COMMUNICATION):
        return "communication"
    return "other"


@contextmanager
def profiled(trace_path: Path, device: torch.device, result: dict[str, Any], top: int = 15) -> Iterator[None]:
    """Profile the body; write a Chrome trace to `trace_path` and fill `result` with `op_table`'s summary."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        yield
    trace_path.parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(trace_path))
    result.update(op_table(prof.key_averages(), device, top))
    result["trace"] = str(trace_path)


def op_table(events: Any, device: torch.device, top: int = 15) -> dict[str, Any]:
    """Self-time shares per category and the `top` ops by self time.

    Returns {time_basis, total_s, shares: {category: fraction}, fp8_gemm (the FP8 GEMMs' fraction, inside the GEMM
    share), top_ops: [{name, category, calls, self_s, share}]}.
    """
    on_gpu = device.type == "cuda"
    rows = []
    for e in events:
        self_us = e.self_device_time_total if on_gpu else e.self_cpu_time_total
        if self_us > 0:
            rows.append((e.key, e.count, self_us / 1e6))
    total = sum(r[2] for r in rows) or 1.0
    shares = dict.fromkeys(CATEGORIES, 0.0)
    fp8 = 0.0
    for name, _, seconds in rows:
        shares[category(name)] += seconds / total
        if category(name) == "gemm" and any(k in name.lower() for k in _FP8_GEMM):
            fp8 += seconds / total
    rows.sort(key=lambda r: r[2], reverse=True)
    return {
        "time_basis": "self device time" if on_gpu else "self CPU time",
        "total_s": total,
        "shares": shares,
        "fp8_gemm": fp8,
        "top_ops": [
            {"name": n, "category": category(n), "calls": c, "self_s": s, "share": s / total} for n, c, s in rows[:top]
        ],
    }
