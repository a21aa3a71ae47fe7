"""`train-demo` in stages, on a recipe of a few steps: the checkpoint it writes loads and generates, and a run
stopped at a stage boundary and twice between DiT steps, then resumed, writes the same weights bit for bit."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from h3serve.checkpoint.resolver import read_layout
from h3serve.demo.training.stages import (
    STATE_DIR,
    DemoTraining,
    StopSignal,
    plan_stages,
    resume_demo,
    train_demo,
)
from h3serve.demo.training.train import LOSS_PLOT, RUN16, TEXT_RESIDUAL_SCALE, TRAINING_FILE
from h3serve.loading.components import load_components
from h3serve.model.pipeline import H3Pipeline
from h3serve.rules.request import GenerationRequest
from h3serve.rules.validate import validate
from h3serve.tools.tiny.make_checkpoint import build_tiny_checkpoint

pytestmark = pytest.mark.slow

TEXT_ENCODER_FILE = "text_encoder/model.safetensors"
# The newest recipe at a few steps (its drawn inputs included): one example of each kind (FL2VA with each set of
# keyframes, on short clips), batches of two on two replicas, each DiT's steps in parts of 3, so `transformer`
# (2 + 6 steps) runs in three stages and `transformer_ref` (1 + 4) in two.
FEW = dataclasses.replace(RUN16.scaled(0.004), video_vae_steps=2, t2va_short_clips=0, fl2va_clips=0,
                          fl2va_short_clips=3, ref2va_clips=0, ref2va_short_clips=1, dit_batch=2, dit_prior_steps=2,
                          dit_steps=6, ref_dit_steps=4, dit_stage_steps=3)
WEIGHTS = ("vae/diffusion_pytorch_model.safetensors", "audio_vae/diffusion_pytorch_model.safetensors",
           "transformer/diffusion_pytorch_model.safetensors", "transformer_ref/diffusion_pytorch_model.safetensors",
           TEXT_ENCODER_FILE)


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """`FEW` trained in one session."""
    out = train_demo(tmp_path_factory.mktemp("uninterrupted") / "demo", FEW, progress=False)
    assert out is not None
    return out


def test_the_stages_cut_each_dit_into_parts_of_at_most_dit_stage_steps():
    labels = [(s.label, s.start, s.until) for s in plan_stages(FEW)]
    assert labels == [("video_vae", 0, 2), ("audio_vae", 0, 2), ("examples", 0, 0), ("transformer.1", 0, 3),
                      ("transformer.2", 3, 5), ("transformer.3", 5, 8), ("transformer_ref.1", 0, 2),
                      ("transformer_ref.2", 2, 5), ("checkpoint", 0, 0)]


def test_train_demo_writes_a_checkpoint_that_loads_and_generates(trained, tmp_path):
    out = trained
    assert not (out / STATE_DIR).exists()  # the folder is the checkpoint alone
    for name in ("vae", "audio_vae"):  # nothing of the folder it was trained in
        assert "_name_or_path" not in json.loads((out / name / "config.json").read_text(encoding="utf-8"))
    # The frozen text encoder ships as it was trained with: the seed's, its residual projections scaled, in float16.
    random = build_tiny_checkpoint(tmp_path / "random", seed=FEW.seed, preset="demo")
    with safe_open(random / TEXT_ENCODER_FILE, "pt") as before, safe_open(out / TEXT_ENCODER_FILE, "pt") as after:
        assert set(before.keys()) == set(after.keys())
        for key in before.keys():
            scale = TEXT_RESIDUAL_SCALE if key.endswith(("self_attn.o_proj.weight", "mlp.down_proj.weight")) else 1.0
            expected = (before.get_tensor(key) * scale).to(torch.float16)
            assert torch.equal(after.get_tensor(key), expected), key
    assert (out / LOSS_PLOT).stat().st_size > 1000
    record = json.loads((out / TRAINING_FILE).read_text(encoding="utf-8"))
    assert record["recipe"] == dataclasses.asdict(FEW) and record["device"].startswith("cpu: ")
    assert set(record["stage_minutes"]) == {"video_vae", "audio_vae", "examples", "transformer", "transformer_ref"}
    assert sum(record["stage_minutes"].values()) <= record["minutes"] + 0.1
    assert [s["stage"] for s in record["stages"]] == [s.label for s in plan_stages(FEW)][:-1]
    assert set(record["final_losses"]) == {"video_vae", "audio_vae", "transformer", "transformer_ref"}
    layout = read_layout(out)
    plan = validate(GenerationRequest(prompt="a red ball bouncing, with a high beep", duration_s=4, steps=1,
                                      seed=0), layout.defaults())
    result = H3Pipeline(load_components(layout)).generate(plan)
    assert tuple(result.video.shape) == (107, 64, 128, 3) and torch.isfinite(result.audio).all()
    with pytest.raises(FileExistsError):
        train_demo(out, FEW, progress=False)
    with pytest.raises(FileExistsError, match="nothing to resume"):
        resume_demo(out, progress=False)


class StopAtCall:
    """A `stop()` that turns true at its `at`-th call: the runner asks before each stage and before each DiT step."""

    def __init__(self, at: int):
        self.at, self.calls = at, 0

    def __call__(self) -> bool:
        self.calls += 1
        return self.calls >= self.at


def test_a_resumed_run_writes_the_uninterrupted_runs_weights_bit_for_bit(trained, tmp_path):
    out = tmp_path / "demo"
    # Session 1: the video VAE, then stops at the next stage boundary.
    assert train_demo(out, FEW, progress=False, stop=StopAtCall(2)) is None
    assert DemoTraining.resume(out, progress=False).remaining[0].label == "audio_vae"
    # Session 2: the audio VAE, the examples, transformer.1's 3 steps, then stops in transformer.2 after 1 step
    # (calls: 3 stages, 3 steps, 1 stage, 1 step, then the one that stops).
    assert resume_demo(out, progress=False, stop=StopAtCall(9)) is None
    state = DemoTraining.resume(out, progress=False)
    assert state.remaining[0].label == "transformer.2" and (out / STATE_DIR / "transformer.pt").is_file()
    assert torch.load(out / STATE_DIR / "transformer.pt", weights_only=True)["trainer"]["step"] == 4
    # Session 3: the rest of transformer.2 (1 stage, 1 step), transformer.3 (1 stage, 3 steps), transformer_ref.1's
    # first step (1 stage, 1 step), then stops; session 4: to the end.
    assert resume_demo(out, progress=False, stop=StopAtCall(2 + 4 + 2 + 1)) is None
    assert DemoTraining.resume(out, progress=False).remaining[0].label == "transformer_ref.1"
    assert torch.load(out / STATE_DIR / "transformer_ref.pt", weights_only=True)["trainer"]["step"] == 1
    assert resume_demo(out, progress=False) == out
    for name in WEIGHTS:
        assert (out / name).read_bytes() == (trained / name).read_bytes(), name
    resumed, whole = (json.loads((d / TRAINING_FILE).read_text(encoding="utf-8")) for d in (out, trained))
    assert resumed["final_losses"] == whole["final_losses"] and resumed["recipe"] == whole["recipe"]
    assert resumed["sessions"] == 4 and whole["sessions"] == 1


def test_stop_signal_turns_true_on_sigterm_and_restores_the_handler():
    before = signal.getsignal(signal.SIGTERM)
    with StopSignal(budget_minutes=60) as stop:
        assert not stop()
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop() and stop.reason == "SIGTERM received"
    assert signal.getsignal(signal.SIGTERM) is before
    with StopSignal(budget_minutes=1e-9) as spent:
        assert spent() and "budget" in spent.reason
