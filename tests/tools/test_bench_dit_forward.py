"""`h3serve bench --dit-forward`: one DiT forward, h3serve's variants against diffusers on shared weights."""

from __future__ import annotations

import pytest
import torch
from small_dit import SMALL_DIT

from h3serve.accel.quantize import selected_linears
from h3serve.config.quantization_config import ComponentQuant, parse_quantization
from h3serve.entrypoints.cli import main
from h3serve.model.transformer import H3Transformer, H3TransformerConfig
from h3serve.tools.bench.dit_forward import REFERENCE, DitBenchSpec, run_dit_bench, summary
from h3serve.tools.bench.flops import forward_flops


def _spec(**kw) -> DitBenchSpec:
    base = dict(
        width=128,
        height=64,
        num_frames=22,
        text_rows=5,
        device=torch.device("cpu"),
        dtype=torch.float32,
        model=None,
        random_config=H3TransformerConfig(**SMALL_DIT),
        modes=("eager",),
        warmup=0,
        runs=3,
        gemm_seconds=0.05,
    )
    return DitBenchSpec(**(base | kw))


def test_eager_is_bit_identical_to_diffusers_and_the_report_has_every_figure():
    lines: list[str] = []
    result = run_dit_bench(_spec(), lines.append)
    assert [v.name for v in result.variants] == [REFERENCE, "eager"]
    eager = result.result("eager")
    assert eager.max_diff_video == 0 and eager.max_diff_audio == 0  # same weights, same kernels, fused Q/K/V
    assert all(len(v.times) == 3 and min(v.times) > 0 for v in result.variants)
    assert result.flops == forward_flops(result.config, result.shape) > 0
    # 5 text rows, 2 channels x 37 audio latents (22 frames at 40/s), 7 latent frames of 2x4 patches
    assert (result.shape.text_rows, result.shape.audio_rows, result.shape.video_rows) == (5, 74, 56)
    assert eager.profile is not None and abs(sum(eager.profile["shares"].values()) - 1) < 1e-6
    text = summary(result)
    assert "| eager |" in text and "| diffusers |" in text and "Same-kernel floor" in text
    assert any(line.startswith("[dit-forward] round 2") for line in lines)


def test_a_checkpoint_dit_loads_and_matches(tiny_checkpoint):
    result = run_dit_bench(_spec(model=tiny_checkpoint, random_config=None, runs=1, profile=False), lambda _: None)
    assert result.config.num_layers == 6 and result.result("eager").max_diff_video == 0


def test_cli_refusals_name_the_flag(capsys):
    assert main(["bench", "--dit-forward", "--dit-layers", "1", "--preset", "tiny", "--shape", "128x64x22"]) == 2
    assert "--dit-layers" in capsys.readouterr().err
    assert main(["bench", "--dit-forward", "--dit-modes", "fast", "--shape", "128x64x22"]) == 2
    assert "--dit-modes" in capsys.readouterr().err
    assert main(["bench", "--dit-forward", "--preset", "tiny"]) == 2
    assert "--shape" in capsys.readouterr().err
    code = main(
        ["bench", "--dit-forward", "--dit-layers", "1", "--shape", "128x64x22", "--attention-backend", "FLASH_ATTN"]
    )
    assert code == 2 and "FLASH_ATTN: needs a CUDA device" in capsys.readouterr().err


@pytest.mark.slow  # two variants profiled, two GEMM-peak probes: ~10 s of CPU
def test_fp8_variants_run_beside_full_precision_on_cpu_weight_only():
    lines: list[str] = []
    spec = _spec(quantization=parse_quantization("fp8", None), runs=1)
    result = run_dit_bench(spec, lines.append)
    assert [v.name for v in result.variants] == [REFERENCE, "eager", "fp8 eager"]
    fp8, full = result.result("fp8 eager"), result.result("eager")
    assert 0 < fp8.max_diff_video < 0.1 and 0 < fp8.max_diff_audio < 0.1  # e4m3 rounding, not a broken forward
    with torch.device("meta"):
        model = H3Transformer(H3TransformerConfig(**SMALL_DIT))
    layers = [model.get_submodule(n) for n in selected_linears(model, "transformer", ComponentQuant())]
    saved = sum(3 * m.weight.numel() - 4 * m.out_features for m in layers)  # fp32 -> 1 byte + a scale a row
    assert (full.weight_mb - fp8.weight_mb) * 2**20 == pytest.approx(saved)
    assert any("kernel: weight-only FP8" in line for line in lines)  # the CPU path, logged
    assert fp8.profile is not None and fp8.profile["fp8_gemm"] == 0  # weight-only: no FP8 GEMM on CPU
    assert "| fp8 eager |" in summary(result)


@pytest.mark.slow  # the tiny checkpoint's 6-block DiT, full and FP8, through the CLI
def test_cli_dit_forward_takes_the_engine_quantization(tiny_checkpoint, capsys):
    code = main(
        [
            "bench",
            "--dit-forward",
            "--model",
            str(tiny_checkpoint),
            "--shape",
            "128x64x22",
            "--engine",
            "quantization=per_tensor",
            "--dit-modes",
            "eager",
            "--runs",
            "1",
            "--warmup",
            "0",
            "--gemm-seconds",
            "0.05",
            "--text-rows",
            "4",
        ]
    )
    out = capsys.readouterr()
    assert code == 0 and "| fp8 eager |" in out.out and "transformer (per_tensor)" in out.err
