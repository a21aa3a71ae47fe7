"""`h3serve bench --full-depth` without a GPU: the full-size configuration checked on the meta device (the released
DiT at full depth, the Qwen3-VL-32B text encoder as the engine truncates it, the released VAEs), which parts the
planner lets run at the released size beside the DiT on an H200 and on an 80 GB card, and a clear refusal on CPU."""

from __future__ import annotations

import numpy as np
import torch

from h3serve.entrypoints import cli
from h3serve.entrypoints.plan import plan_from_argv
from h3serve.model.transformer import H3TransformerConfig
from h3serve.rules import limits
from h3serve.tools.bench.flops import ForwardShape, forward_flops
from h3serve.tools.bench.full_depth import (
    RELEASED,
    TINY,
    _encoders,
    released_dit,
    released_sizes,
    released_text_encoder,
    released_vaes,
)
from h3serve.tools.tiny.make_text import build_tokenizer

META, BF16, GiB = torch.device("meta"), torch.bfloat16, 2**30


def _params(module) -> float:
    return sum(p.numel() for p in module.parameters()) / 1e9


def test_the_full_size_parts_on_the_meta_device():
    text = released_text_encoder(META, BF16, build_tokenizer())
    hidden = text.model.config.text_config.hidden_size
    assert len(text.model.language_model.layers) == limits.TEXT_ENCODER_LAYER + 1 == 51  # the layers read
    assert hidden == H3TransformerConfig().text_dim == 5120 and round(_params(text.model), 1) == 26.2
    assert next(text.model.parameters()).dtype == BF16
    dit = released_dit(META, BF16, hidden, seed=0)
    assert (len(dit.transformer_blocks), len(dit.token_refiner.refiner_blocks)) == (50, 2)
    assert dit.config == H3TransformerConfig() and round(_params(dit), 1) == 33.1
    vae, audio = released_vaes(META, BF16)
    assert round(_params(vae), 2) == 2.60 and next(vae.parameters()).dtype == BF16
    assert next(audio.parameters()).dtype == torch.float32 and audio.config.latent_channels == 32
    # 1344x768x124 (5 s): 32 latent frames of 24 x 42 patches, 207 audio latents: ~2.8 PFLOP a forward (3.6 s at
    # the H200's measured 778 TFLOP/s GEMM peak)
    shape = ForwardShape(video_rows=32 * 24 * 42, audio_rows=207, text_rows=64, timesteps=2)
    assert 2.5e15 < forward_flops(dit.config, shape) < 3.0e15


def test_the_planner_decides_which_parts_run_at_the_released_size():
    h200, _ = released_sizes(int(139.3 * GiB), 1344, 768, 124, plan_from_argv)
    assert h200 == {"dit": RELEASED, "text_encoder": RELEASED, "vae": RELEASED, "audio_vae": RELEASED}
    h100, plan = released_sizes(int(79.2 * GiB), 1344, 768, 124, plan_from_argv)
    assert h100 == {"dit": RELEASED, "text_encoder": TINY, "vae": RELEASED, "audio_vae": RELEASED}
    assert plan.ranks[0].stage("denoise").weights["transformer"] > 61 * GiB  # 33.1 B parameters in bf16


def test_on_cpu_the_mode_says_it_needs_a_gpu(tiny_checkpoint, tmp_path, capsys):
    code = cli.main(["bench", "--full-depth", "--model", str(tiny_checkpoint), "--out", str(tmp_path)])
    assert code == 2 and "runs the released DiT on one GPU; this machine has none" in capsys.readouterr().err
    assert cli.main(["bench", "--full-depth", "--out", str(tmp_path)]) == 2  # no --model


def test_the_encoder_comparison_writes_x264_and_says_why_nvenc_did_not_run(tmp_path):
    """The row's "NVENC against x264": x264 from the host frames; NVENC from the same frames on the device, where
    the device has one (a CPU has none: recorded as skipped, with the reason)."""
    video = np.random.default_rng(0).random((6, 32, 64, 3), dtype=np.float32)
    audio = np.zeros((2, 8000), np.float32)
    results = _encoders(tmp_path, video, audio, torch.device("cpu"))
    assert results["x264"]["bytes"] == (tmp_path / "full_depth-x264.mp4").stat().st_size > 0
    assert results["nvenc"] == {"error": "skipped: the frames are on cpu, not a CUDA device"}
