"""session.start's fields as vLLM-Omni reads them: sampling_params folded in, size over width/height, seconds into
frames, the defaults of a session, and the few rules checked before the engine's."""

from __future__ import annotations

import pytest

from h3serve.api.realtime.events import SessionStart
from h3serve.errors import RequestError
from h3serve.rules import limits


def start(**fields) -> SessionStart:
    return SessionStart.model_validate(SessionStart.fold({"type": "session.start", "prompt": "p", **fields}))


def test_defaults_are_the_session_canvas_seed_and_ten_minutes():
    spec = start().spec("tiny")
    assert (spec.width, spec.height) == limits.REALTIME_DEFAULT_SIZE
    assert (spec.seed, spec.num_frames, spec.extra) == (limits.DEFAULT_SEED, limits.MAX_REALTIME_FRAMES, {})


def test_sampling_params_fold_into_the_fields_or_extra_params():
    spec = start(seed=1, sampling_params={"seed": 2, "num_frames": 48, "guidance_scale": 3.0, "shift": 5},
                 extra_params={"task": "t2va"}).spec("tiny")
    assert (spec.seed, spec.num_frames) == (1, 48)  # the top-level field stays; the other seed joins extra_params
    assert spec.extra == {"seed": 2, "guidance_scale": 3.0, "shift": 5, "task": "t2va"}


def test_size_seconds_fps_and_video_params():
    spec = start(size="864x480", width=64, height=64, seconds="2", fps=24).spec("tiny")
    assert (spec.width, spec.height, spec.num_frames, spec.extra["fps"]) == (864, 480, 48, 24)
    spec = start(video_params={"width": 128, "height": 64, "num_frames": 30}).spec("tiny")
    assert (spec.width, spec.height, spec.num_frames) == (128, 64, 30)


def test_fields_a_session_does_not_take_reach_its_rules():
    assert start(num_inference_steps=8, lora={"name": "x"}).spec("tiny").extra == {"num_inference_steps": 8,
                                                                                      "lora": {"name": "x"}}


@pytest.mark.parametrize(("fields", "field"), [({"model": "other"}, "model"), ({"width": 64}, "height"),
                                               ({"height": 64}, "width")])
def test_refused_before_the_engine(fields, field):
    with pytest.raises(RequestError) as refused:
        start(**fields).spec("tiny")
    assert refused.value.field == field
