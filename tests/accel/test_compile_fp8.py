"""Regional torch.compile of an FP8 DiT (weight-only path): no eager fallback, no graph break in the FP8
linears, one graph per block kind, and the output of eager FP8."""

from __future__ import annotations

import pytest
import torch
from test_compile import _model, _run

from h3serve.accel.compile import CompileState, compile_transformer
from h3serve.accel.fp8 import Fp8Linear
from h3serve.accel.quantize import quantize_in_place
from h3serve.config.quantization_config import ComponentQuant


def _fp8_model():
    model = _model()
    quantize_in_place(model, "transformer", ComponentQuant(), torch.float32, "weight_only")
    model.fuse_projections()
    assert isinstance(model.transformer_blocks[0].attn.to_qkv, Fp8Linear)
    return model


@pytest.mark.slow
def test_regional_compile_of_fp8_blocks_equals_eager_fp8():
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()  # the counters outlive reset(): earlier compile tests in this process
    eager, compiled = _fp8_model(), _fp8_model()
    lines: list[str] = []
    compile_transformer(compiled, "regional", True, CompileState(log=lines.append), backend="aot_eager")
    for frames in (5, 7):
        for ours, theirs in zip(_run(compiled, frames), _run(eager, frames), strict=True):
            assert (ours - theirs).abs().max() <= 1e-5
    assert lines == []  # no fallback to eager
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 2  # main blocks, refiner block
