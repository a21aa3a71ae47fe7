"""FP8 in the bench: `quantization=` engine options in a matrix, and the one-block FP8 error mode."""

from __future__ import annotations

import pytest
from small_dit import SMALL_DIT

from h3serve.config.quantization_config import parse_quantization
from h3serve.model.transformer import H3TransformerConfig
from h3serve.tools.bench.fp8_block import block_errors, summary
from h3serve.tools.bench.matrix import EngineSpec, MatrixError


def test_matrix_engines_take_a_quantization(tmp_path):
    model = tmp_path  # EngineSpec.config builds the config only (no checkpoint is read)
    spec = EngineSpec.parse("name=fp8,quantization=per_tensor,threads=1", 0)
    assert spec.options["quantization"] == "per_tensor"  # recorded as written
    assert spec.config(model).quantization == parse_quantization("fp8", '{"granularity": "per_tensor"}')
    yaml_like = EngineSpec.parse({"name": "q", "quantization": {"text_encoder": False}}, 1)
    assert yaml_like.config(model).quantization.component("text_encoder") is None
    plain = EngineSpec.parse("quantization=fp8", 2).config(model)
    assert plain.quantization == parse_quantization("fp8", None)
    for bad in ("quantization=int4", "quantization=per_block"):
        with pytest.raises(MatrixError, match="engine option quantization: expected fp8, per_channel, per_tensor"):
            EngineSpec.parse(bad, 0)


def test_one_block_fp8_error_is_small_but_real():
    cfg = H3TransformerConfig(**SMALL_DIT)
    errors = block_errors(cfg, rows=64, seed=1)
    assert [e.granularity for e in errors] == ["per_channel", "per_tensor"]
    for e in errors:
        assert 1e-4 < e.relative_l2 < 0.2 and e.cosine > 0.98
    assert "| per_tensor |" in summary(cfg, 64, errors)
