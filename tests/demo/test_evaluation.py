"""The demo evaluation's cases run every task through the real pipeline (here the random tiny checkpoint, one step:
the plumbing, not the model) and report the checks each task promises."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from h3serve.demo.evaluation import TASKS, DemoEvaluator, EvalCase, band_mask, case_attributes, summarize
from h3serve.demo.world import scenes as world
from h3serve.demo.world.grammar import MOTIONS, SOUNDS

pytestmark = pytest.mark.slow


def test_seeds_0_to_9_meet_every_motion_with_both_sounds():
    pairs = {(case_attributes(s).motion, case_attributes(s).sound) for s in range(10)}
    assert pairs == {(m, s) for m in MOTIONS for s in SOUNDS}


def test_band_mask_covers_the_path_and_keeps_the_rest():
    scene = world.Scene(case_attributes(1), x0=8.0, y0=0.0)  # moving right in latent row 0, plus one row of margin
    mask = band_mask(scene, 32, 4, 8)
    assert mask.shape == (32, 4, 8) and mask[:, 0:2].all() and not mask[:, 2:].any()


def test_summarize_counts_right_cases_and_each_wrong_check():
    cases = [
        EvalCase("t2va", 0, "p", {"color": True, "motion": True}),
        EvalCase("t2va", 1, "p", {"color": False, "motion": False}),
        EvalCase("t2va", 2, "p", {"color": True, "motion": False}),
        EvalCase("t2va", 3, "p", {}),  # nothing measured is not right
    ]
    assert summarize(cases) == {"cases": 4, "right": 1, "wrong": {"motion": 2, "color": 1}, "failed_seeds": [1, 2, 3]}


@pytest.fixture(scope="module")
def cases(tiny_pipeline):
    pipeline, defaults = tiny_pipeline
    evaluator = DemoEvaluator(pipeline, defaults, steps=1)
    return {task: evaluator.run(task, 1) for task in RUN}


# Every task's code path once: the keyframe rows with each anchor set, the drawn inputs in one keyframe and one
# reference row (the others differ only in their inputs, tested below without generating).
RUN = ("t2va", "fl2va", "fl2va_last", "fl2va_both_drawn", "ref2va", "ref2va_named_drawn", "continuation", "edit")


def test_every_task_reports_its_checks(cases):
    assert set(cases["t2va"].checks) == {"color", "motion", "pitch", "pan"}
    assert set(cases["fl2va"].checks) == {"keyframe", "color", "motion", "pitch", "pan"}
    assert set(cases["fl2va_last"].checks) == {"last_keyframe", "color", "motion", "pitch", "pan"}
    assert set(cases["fl2va_both_drawn"].checks) == {"keyframe", "last_keyframe", "color", "motion", "pitch", "pan"}
    for row in ("ref2va", "ref2va_named_drawn"):
        assert set(cases[row].checks) == {"color", "motion", "pitch", "pan"}
    assert cases["continuation"].checks["windows"] is True
    assert {k.split("_")[0] for k in cases["continuation"].checks} == {"windows", "window0", "window1", "window2"}
    assert set(cases["edit"].checks) == {"color", "kept", "motion"}
    assert cases["ref2va"].prompt == "the ball from the reference image moving right, with the reference sound"
    assert cases["ref2va_named_drawn"].prompt == "the ball from the reference image moving right, with a high beep"
    assert {case.task for case in cases.values()} == set(RUN) and set(RUN) < set(TASKS) and len(TASKS) == 13


def test_the_drawn_rows_give_the_pipeline_what_a_person_made(tiny_pipeline, monkeypatch):
    """The `_drawn` rows' inputs differ from the world's (and from each other's seeds); the world's rows keep the
    inputs the recorded rates were measured on (seed 1: the scene at rng 1001, its first frame)."""
    pipeline, defaults = tiny_pipeline
    evaluator = DemoEvaluator(pipeline, defaults, steps=1)
    seen = []
    monkeypatch.setattr(evaluator, "generate", lambda plan, cond=None: seen.append(cond) or evaluator_output(plan))
    evaluator.run("fl2va", 1)
    evaluator.run("fl2va_drawn", 1)
    evaluator.run("fl2va_drawn", 2)
    world_frame = world.render_video(world.sample_scene(np.random.default_rng(1001), "fl2va", 128, 64, 1,
                                                        case_attributes(1)))[0]
    assert np.array_equal(np.asarray(seen[0].keyframes[0]), world_frame)
    assert seen[1].keyframes[0].size == (128, 64)  # the server's fit put it on the canvas
    assert not np.array_equal(np.asarray(seen[1].keyframes[0]), world_frame)
    assert not np.array_equal(np.asarray(seen[1].keyframes[0]), np.asarray(seen[2].keyframes[0]))
    evaluator.run("ref2va", 1)
    evaluator.run("ref2va_drawn", 1)
    world_ref, drawn_ref = (cond.references for cond in seen[3:])
    assert world_ref[0].image.size == (64, 64) and torch.equal(world_ref[1].audio, torch.from_numpy(
        world.reference_audio(case_attributes(1).sound)))
    assert drawn_ref[1].audio.shape != world_ref[1].audio.shape


def evaluator_output(plan):
    """A blank clip of the plan's size (the inputs are what is tested)."""
    return np.zeros((plan.num_frames, plan.height, plan.width, 3), np.uint8), np.zeros((2, 32000), np.float32)
