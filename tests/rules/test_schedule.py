"""Step counts (denoiser forwards) and pinned schedules: h3serve/rules/schedule.py and how validate applies them."""

from __future__ import annotations

import dataclasses

import pytest

from h3serve.rules import limits
from h3serve.rules.request import GenerationRequest
from h3serve.rules.schedule import (
    PinnedSchedule,
    check_positions,
    resolve_pinned_shift,
    resolve_steps,
    shift_sigma,
    shifted_sigmas,
    uniform_positions,
)
from h3serve.rules.validate import ModelDefaults, RequestError, validate  # RequestError: h3serve.errors's

FASTH3 = (0.999, 0.749, 0.5, 0.25, 0.0)


def rounded(values: tuple[float, ...]) -> list[float]:
    return [round(v, 5) for v in values]


def test_fasth3_positions_under_the_checkpoint_shifts():
    assert rounded(shifted_sigmas(FASTH3, 12.0)) == [0.99992, 0.97283, 0.92308, 0.8, 0.0]
    assert rounded(shifted_sigmas(FASTH3, 3.0)) == [0.99967, 0.89952, 0.75, 0.5, 0.0]


def test_turbo_four_steps_at_shift_six():
    assert uniform_positions(4) == (1.0, 0.75, 0.5, 0.25, 0.0)
    assert rounded(shifted_sigmas(uniform_positions(4), 6.0)) == [1.0, 0.94737, 0.85714, 0.66667, 0.0]


@pytest.mark.parametrize("steps", [1, 2, 3, 7, 50, 200])
def test_uniform_positions_are_n_plus_one_points(steps):
    points = uniform_positions(steps)
    assert len(points) == steps + 1 and points[0] == 1.0 and points[-1] == 0.0
    assert all(a - b == pytest.approx(1 / steps) for a, b in zip(points, points[1:], strict=False))


def test_shift_keeps_the_ends_and_one_is_identity():
    for shift in (0.5, 1.0, 3.0, 12.0, 100.0):
        assert shift_sigma(1.0, shift) == 1.0 and shift_sigma(0.0, shift) == 0.0
    assert shifted_sigmas(FASTH3, 1.0) == FASTH3


def test_pinned_schedule_with_positions():
    pin = PinnedSchedule("adapter 'fasth3'", positions=[0.999, 0.749, 0.5, 0.25, 0])
    assert pin.positions == FASTH3 and pin.forwards == pin.steps == 4
    assert PinnedSchedule("x", positions=FASTH3, steps=4).forwards == 4
    with pytest.raises(ValueError, match=r"x: steps=3 but 5 positions \(4 forwards\)"):
        PinnedSchedule("x", positions=FASTH3, steps=3)


def test_pinned_schedule_uniform_needs_steps():
    assert PinnedSchedule("turbo", steps=4, flow_shift=6.0).positions is None
    for bad in (None, 0, -1, True, 2.0):
        with pytest.raises(ValueError, match="turbo: a uniform pinned schedule needs steps >= 1"):
            PinnedSchedule("turbo", steps=bad)
    for shift in (0.0, -1.0, float("nan"), limits.MAX_FLOW_SHIFT + 1):
        with pytest.raises(ValueError, match="turbo: flow_shift must be in"):
            PinnedSchedule("turbo", steps=4, flow_shift=shift)


@pytest.mark.parametrize(
    "positions, message",
    [
        ((0.0,), "at least 2 positions"),
        ((), "at least 2 positions"),
        ((1.5, 0.0), r"start in \(0, 1\] and end at 0"),
        ((0.0, 0.0), r"start in \(0, 1\] and end at 0"),
        ((1.0, 0.5, 0.1), r"start in \(0, 1\] and end at 0"),
        ((1.0, float("nan"), 0.0), r"start in \(0, 1\] and end at 0"),
        ((1.0, 0.5, 0.5, 0.0), "strictly decreasing"),
        ((1.0, 0.25, 0.5, 0.0), "strictly decreasing"),
    ],
)
def test_bad_positions(positions, message):
    with pytest.raises(ValueError, match=message):
        check_positions(positions, "adapter 'a'")
    with pytest.raises(ValueError, match="adapter 'a'"):
        PinnedSchedule("adapter 'a'", positions=positions)


def test_resolve_steps_without_a_pin():
    assert resolve_steps(None, None) == limits.DEFAULT_STEPS == 50
    assert resolve_steps(None, None, default=8) == 8
    assert resolve_steps(limits.MIN_STEPS, None) == 1 and resolve_steps(limits.MAX_STEPS, None) == 200
    for bad in (0, -3, limits.MAX_STEPS + 1):
        with pytest.raises(RequestError, match=f"steps: must be between 1 and 200, got {bad}"):
            resolve_steps(bad, None)
    for bad in (True, 2.5, "4"):
        with pytest.raises(RequestError, match="steps: must be an integer"):
            resolve_steps(bad, None)


def test_resolve_steps_with_a_pin():
    pin = PinnedSchedule("adapter 'fasth3'", positions=FASTH3)
    assert resolve_steps(None, pin) == resolve_steps(4, pin) == 4
    for other in (1, 3, 5, 50):
        with pytest.raises(RequestError) as err:
            resolve_steps(other, pin)
        assert err.value.field == "steps"
        assert err.value.message == (f"adapter 'fasth3' runs exactly 4 steps (denoiser forwards); omit the field "
                                     f"or send 4, got {other}")
    with pytest.raises(RequestError, match="must be an integer"):
        resolve_steps(4.0, pin)


def test_resolve_pinned_shift():
    pin = PinnedSchedule("adapter 'turbo'", steps=4, flow_shift=6.0)
    assert resolve_pinned_shift("flow_shift", None, pin) == resolve_pinned_shift("flow_shift", 6, pin) == 6.0
    assert resolve_pinned_shift("audio_flow_shift", 7.0, pin) is None  # not pinned: the caller's rule
    assert resolve_pinned_shift("flow_shift", 7.0, None) is None
    with pytest.raises(RequestError, match="flow_shift: adapter 'turbo' runs at flow_shift 6 \\(4 steps\\); omit "
                                            "the field or send 6, got 12.0"):
        resolve_pinned_shift("flow_shift", 12.0, pin)


# -- through validate ------------------------------------------------------------------------------------------

TINY = ModelDefaults(canvas_short_edge=64, canvas_max_pixels=64 * 128)


def plan_with(pin: PinnedSchedule | None, **request):
    defaults = dataclasses.replace(TINY, pinned_schedule=pin)
    return validate(GenerationRequest(prompt="x", **request), defaults)


def test_validate_without_a_pin_counts_forwards():
    plan = plan_with(None)
    assert plan.steps == 50 and plan.pinned_positions is None
    assert (plan.flow_shift, plan.audio_flow_shift) == (12.0, 3.0)
    assert plan_with(None, steps=1).steps == 1
    with pytest.raises(RequestError, match="steps: must be between 1 and 200, got 0"):
        plan_with(None, steps=0)


def test_validate_applies_a_positions_pin():
    pin = PinnedSchedule("adapter 'fasth3'", positions=FASTH3)
    for steps in (None, 4):
        plan = plan_with(pin, steps=steps)
        assert plan.steps == 4 and plan.pinned_positions == FASTH3
    assert plan_with(pin, flow_shift=10.0).flow_shift == 10.0  # shifts not pinned: the request's own
    with pytest.raises(RequestError) as err:
        plan_with(pin, steps=8)
    assert err.value.field == "steps" and "adapter 'fasth3' runs exactly 4 steps" in err.value.message


def test_validate_applies_a_uniform_pin_with_shifts():
    pin = PinnedSchedule("adapter 'minimax_h3_fl2v_turbo_4step_v1.0_768p'", steps=4, flow_shift=6.0,
                         audio_flow_shift=3.0)
    plan = plan_with(pin, flow_shift=6.0)
    assert (plan.steps, plan.pinned_positions, plan.flow_shift, plan.audio_flow_shift) == (4, None, 6.0, 3.0)
    with pytest.raises(RequestError, match="flow_shift: adapter 'minimax_h3_fl2v_turbo_4step_v1.0_768p' runs at "
                                           "flow_shift 6"):
        plan_with(pin, flow_shift=12.0)
    with pytest.raises(RequestError, match="steps: adapter 'minimax_h3_fl2v_turbo_4step_v1.0_768p' runs exactly "
                                           "4 steps"):
        plan_with(pin, steps=50)
