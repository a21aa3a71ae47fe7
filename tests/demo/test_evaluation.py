"""The demo evaluation's cases run every task through the real pipeline (here the random tiny checkpoint, one step:
the plumbing, not the model) and report the checks each task promises."""

from __future__ import annotations

import pytest

from h3serve.demo.evaluation import TASKS, DemoEvaluator, EvalCase, band_mask, case_attributes, summarize
from h3serve.demo.world import world
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
    return {task: evaluator.run(task, 1) for task in TASKS}


def test_every_task_reports_its_checks(cases):
    assert set(cases["t2va"].checks) == {"color", "motion", "pitch", "pan"}
    assert set(cases["fl2va"].checks) == {"keyframe", "color", "motion", "pitch", "pan"}
    assert set(cases["ref2va"].checks) == {"color", "motion", "pitch", "pan"}
    assert cases["continuation"].checks["windows"] is True
    assert {k.split("_")[0] for k in cases["continuation"].checks} == {"windows", "window0", "window1", "window2"}
    assert set(cases["edit"].checks) == {"color", "kept", "motion"}
    assert cases["ref2va"].prompt == "the ball from the reference image moving right, with the reference sound"
