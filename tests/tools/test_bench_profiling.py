"""`--profile`: a Chrome trace plus self-time shares per category (attention / GEMM / communication / other)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from h3serve.tools.bench.profiling import category, profiled


@pytest.mark.parametrize(
    "name, expected",
    [
        ("aten::_scaled_dot_product_flash_attention_for_cpu", "attention"),
        ("aten::_softmax", "attention"),
        ("aten::mm", "gemm"),
        ("aten::addmm", "gemm"),
        ("sm90_xmma_gemm_bf16bf16_bf16f32", "gemm"),
        ("c10d::allreduce_", "communication"),
        ("ncclDevKernel_AllGather_RING_LL", "communication"),
        ("aten::broadcast_tensors", "other"),  # not a collective
        ("aten::mkldnn_convolution", "other"),
    ],
)
def test_categories(name, expected):
    assert category(name) == expected


def test_profiled_run_writes_a_trace_and_shares(tmp_path):
    q = torch.randn(1, 4, 256, 64)
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    result: dict = {}
    with profiled(tmp_path / "p" / "trace.json", torch.device("cpu"), result, top=5):
        for _ in range(3):
            F.scaled_dot_product_attention(q, q, q)
            torch.mm(a, b)
            torch.sin(a)
    assert json.loads((tmp_path / "p" / "trace.json").read_text())["traceEvents"]
    shares = result["shares"]
    assert sum(shares.values()) == pytest.approx(1.0)
    assert shares["attention"] > 0 and shares["gemm"] > 0 and shares["other"] > 0 and shares["communication"] == 0
    assert result["time_basis"] == "self CPU time" and len(result["top_ops"]) <= 5
    top = result["top_ops"]
    assert [o["self_s"] for o in top] == sorted((o["self_s"] for o in top), reverse=True)
    assert {o["name"] for o in top} >= {"aten::mm"}
