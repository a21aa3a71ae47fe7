"""The shipped demo checkpoint shows and sounds what it is asked (issue 28), measured from the output pixels and
samples (h3serve.demo.world.checks): `make demo`'s own command and MP4, and each task over seeds, at no less
than the rate docs/demo_world.md records for the shipped weights (a regression in the model, the pipeline, the
layouts or the decode shows here, where the random tiny checkpoint's parity tests cannot see it)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from h3serve.demo.evaluation import DemoEvaluator, evaluate
from h3serve.demo.shipped import DEMO_PROMPT, shipped_demo_checkpoint
from h3serve.demo.training.examples import ExampleBuilder, render
from h3serve.demo.world import checks
from h3serve.demo.world import scenes as world
from h3serve.demo.world.grammar import Attributes
from h3serve.entrypoints import cli

pytestmark = pytest.mark.slow

# Seeds 0-4 per task (demo_eval.case_attributes: every motion once). The shipped weights (run 15), on the CPU that
# trained them: T2VA 4 of 5 whole (colour and pitch 5, motion 4; the bounce's rebounds and clicks 0 of 1); FL2VA 0 of
# 5 (keyframe 5, colour 4, pitch 5, motion 0); Ref2VA 3 of 5 (colour 4, pitch and motion 5; the bounce's rebounds and
# clicks 1 and 0 of 1). The continuation (three 4 s windows, seeds 0-2): 1 of 3 whole; colour, motion and pitch right
# in 3 / 3 / 3 of window 0, 2 / 3 / 3 of window 1 and 1 / 3 / 3 of window 2. The floors sit one below (another CPU
# may round a borderline case the other way; the window count is the plan's); docs/demo_world.md has every task over
# 10 and 30 seeds.
SEEDS = {"t2va": 5, "fl2va": 5, "ref2va": 5, "continuation": 3}
MIN_PASSED = {"t2va": 3, "fl2va": 0, "ref2va": 2, "continuation": 0}
MIN_RIGHT = {
    "t2va": {"color": 4, "pitch": 4, "motion": 3, "pan": 1},
    "fl2va": {"keyframe": 4, "color": 3, "pitch": 4},
    "ref2va": {"color": 3, "pitch": 4, "motion": 4},
    "continuation": {"windows": 3, "window0_color": 2, "window0_motion": 2, "window0_pitch": 2, "window1_color": 1,
                     "window1_motion": 2, "window1_pitch": 2, "window2_motion": 2, "window2_pitch": 2},
}


@pytest.fixture(scope="module")
def evaluator() -> DemoEvaluator:
    demo = shipped_demo_checkpoint()
    assert demo is not None, "the demo checkpoint ships with h3serve (h3serve/demo/checkpoint)"
    return DemoEvaluator.load(demo)


REQUESTS = {
    "make-demo": ("--steps", "20"),
    "4-steps": ("--steps", "4"),
    "fp8": ("--steps", "20", "--quantization", "fp8"),
}


@pytest.mark.parametrize("options", REQUESTS.values(), ids=REQUESTS.keys())
def test_make_demo_writes_an_mp4_that_shows_what_it_asks(tmp_path, capsys, options):
    """The Makefile's `demo` target: `generate` without --model (the shipped checkpoint), then `check-demo`; and the
    same request in 4 denoiser steps, and with FP8 weights."""
    out = tmp_path / "demo.mp4"
    argv = ["generate", DEMO_PROMPT, "-o", str(out), "--duration", "4", "--seed", "0", *options]
    assert cli.main(argv) == 0
    capsys.readouterr()
    code = cli.main(["check-demo", str(out), "--prompt", DEMO_PROMPT])
    printed = capsys.readouterr().out
    assert code == 0 and "all checks passed" in printed, printed


@pytest.mark.parametrize("task", sorted(MIN_PASSED))
def test_each_task_does_what_it_is_asked_over_seeds(evaluator, task):
    """Each task over its seeds; for the continuation the long-video path on the trained weights (the guided
    windows' audio guide rows, the global timeline, the stitch and the single decode)."""
    cases = evaluate(evaluator, task, range(SEEDS[task]))
    right = {name: sum(c.checks.get(name, False) for c in cases) for name in MIN_RIGHT[task]}
    report = [(c.prompt, {k: int(v) for k, v in c.checks.items()}) for c in cases]
    assert sum(c.passed for c in cases) >= MIN_PASSED[task], report
    assert all(right[name] >= need for name, need in MIN_RIGHT[task].items()), (right, report)


def test_the_selftests_end_to_end_check_runs_the_demo_and_checks_what_it_shows(tmp_path, capsys):
    """`h3serve selftest` without --model: the end-to-end request is the demo's, checked by the demo-world checks."""
    import json

    out = tmp_path / "selftest.json"
    code = cli.main(["selftest", "--device", "cpu", "--only", "end_to_end", "--json", str(out)])
    checks = {o["name"]: o for o in json.loads(out.read_text())}
    capsys.readouterr()
    assert code == 0 and checks["end_to_end"]["status"] == "pass", checks
    assert f"shows {DEMO_PROMPT!r}" in checks["end_to_end"]["figure"]


@pytest.mark.parametrize("sound", ["low hum", "high beep"])
def test_the_audio_vae_keeps_every_click_of_a_bounce(evaluator, sound):
    """What a generated click needs first: the shipped audio VAE encodes and decodes the world's bouncing soundtrack
    with a click at every impact (the VAEs of runs 1-5 kept none), and its tone at its pitch."""
    audio_vae = evaluator.pipeline.components.audio_vae
    scene = world.sample_scene(np.random.default_rng(0), "t2va", 128, 64, 97,
                               Attributes("red", "ball", "bouncing", sound))
    wave = world.render_audio(scene)
    with torch.no_grad():
        latents = audio_vae.encode(torch.from_numpy(wave)[:, None].to(audio_vae.dtype)).latent_dist.mode()
        decoded = audio_vae.decode(latents).sample[:, 0, : wave.shape[1]].float().numpy()
    assert len(world.impact_frames(scene)) == 3
    assert checks.click_frames(decoded) == world.impact_frames(scene)
    assert checks.measure_pitch(decoded) == checks.measure_pitch(wave) == sound


def test_a_first_keyframe_gives_target_frame_0(evaluator):
    """What `train-demo`'s anchor weight (dit.ANCHOR_WEIGHT) rests on: through the trained VAE, a first keyframe's
    condition rows equal the clip's target frame 0 (to within rounding), while frame 1 differs."""
    components = evaluator.pipeline.components
    builder = ExampleBuilder(components, 128, 64, evaluator.defaults.reference_image_short_edge)
    scene = world.sample_scene(np.random.default_rng(0), "fl2va", 128, 64, 107,
                               Attributes("green", "square", "moving right", "low hum"))
    example = builder.keyframes(render(scene), ("first",))
    rows = example.anchored_rows
    assert rows == 8
    assert float((example.conditions - example.video[:rows]).pow(2).mean()) < 1e-3
    assert float((example.conditions - example.video[rows : 2 * rows]).pow(2).mean()) > 1e-2
