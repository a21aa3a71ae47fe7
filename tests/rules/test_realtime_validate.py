"""A real-time session's settings: what is accepted, and every refusal naming the field and the reason."""

from __future__ import annotations

import pytest

from h3serve.errors import RequestError
from h3serve.rules.defaults import ModelDefaults
from h3serve.rules.validate.realtime_plan import plan_realtime

TINY = ModelDefaults(canvas_short_edge=64)


def test_a_valid_session_and_its_chunks():
    plan = plan_realtime("a surfer", 480, 864, 8301, 14_400)
    assert (plan.width, plan.height, plan.seed, plan.num_frames, plan.chunks) == (480, 864, 8301, 14_400, 484)
    assert plan_realtime("x", 64, 128, 0, 1, extra={"fps": 24, "n": 1, "task": "T2VA", "guidance_scale": 3},
                         defaults=TINY).chunks == 4


@pytest.mark.parametrize("kwargs, field, says", [
    ({"prompt": " "}, "prompt", "must not be empty"),
    ({"width": 500}, "width", "multiple of 32"),
    ({"width": 512}, "width", "short edge must be one of 480, 768, 1088"),
    ({"height": 3520}, "height", "wider than 4:1"),
    ({"seed": -1}, "seed", "between 0 and"),
    ({"seed": 1.5}, "seed", "must be an integer"),
    ({"num_frames": 14_401}, "num_frames", "between 1 and 14400"),
    ({"negative_prompt": "blur"}, "negative_prompt", "CFG-distilled"),
    ({"extra": {"num_outputs_per_prompt": 2}}, "num_outputs_per_prompt", "one stream"),
    ({"extra": {"task": "fl2va"}}, "task", "t2va only"),
    ({"extra": {"image": "data:image/png;base64,AAAA"}}, "image", "text-to-video-and-audio only"),
    ({"extra": {"fps": 30}}, "fps", "24 fps"),
    ({"extra": {"num_inference_steps": 8}}, "num_inference_steps", "3 Euler steps per chunk"),
    ({"extra": {"lora": {"name": "x"}}}, "lora", "--realtime-lora"),
])
def test_refusals_name_the_field(kwargs, field, says):
    args = {"prompt": "a surfer", "width": 480, "height": 864, "seed": 1, "num_frames": 100, **kwargs}
    with pytest.raises(RequestError) as err:
        plan_realtime(**args)
    assert err.value.field == field and says in err.value.message
