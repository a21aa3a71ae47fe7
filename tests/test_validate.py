"""Request rules: every limit at its edge and just past it."""

from __future__ import annotations

import pytest

from h3serve import geometry
from h3serve.request import GenerationRequest
from h3serve.validate import ModelDefaults, RequestError, validate


def ok(**kw):
    return validate(GenerationRequest(prompt=kw.pop("prompt", "a cat"), **kw))


def bad(field: str, **kw) -> str:
    with pytest.raises(RequestError) as e:
        ok(**kw)
    assert e.value.field == field
    assert str(e.value).startswith(f"{field}: ")
    assert "\n" not in str(e.value)
    return str(e.value)


@pytest.mark.parametrize("seconds, frames", [(4, 107), (5, 124), (15, 362), (4.5, 124), (10, 243), (14.2, 345)])
def test_duration_snaps_up_to_17n_plus_5(seconds, frames):
    assert ok(duration_s=seconds).num_frames == frames
    assert (frames - 5) % 17 == 0


def test_duration_limits():
    assert ok(duration_s=4).num_frames == 107
    assert "between 4 and 15" in bad("duration", duration_s=3.99)
    assert ok(duration_s=15).num_frames == 362
    assert "between 4 and 15" in bad("duration", duration_s=15.01)
    bad("duration", duration_s=float("nan"))
    bad("duration", duration_s="5")


def test_num_frames_limits_and_conflict():
    assert ok(num_frames=96).num_frames == 107
    bad("num_frames", num_frames=95)
    assert ok(num_frames=360).num_frames == 362
    bad("num_frames", num_frames=361)
    assert ok(num_frames=124, duration_s=5).num_frames == 124
    assert "contradicts" in bad("num_frames", num_frames=200, duration_s=5)


def test_default_frames_are_five_seconds():
    assert ok().num_frames == 124


def test_size_multiples_of_32():
    p = ok(width=1344, height=768)
    assert (p.width, p.height) == (1344, 768)
    assert "multiple of 32" in bad("width", width=1345, height=768)
    assert "multiple of 32" in bad("height", width=1344, height=770)
    assert "together" in bad("height", width=1344)
    bad("width", width=0, height=32)
    bad("width", width=4128, height=1056)


def test_aspect_ratio_limits_on_explicit_size():
    assert ok(width=128, height=32).width == 128  # exactly 4:1
    assert "1:4 to 4:1" in bad("width", width=160, height=32)  # 5:1
    assert ok(width=32, height=128).height == 128  # exactly 1:4
    assert "1:4 to 4:1" in bad("width", width=32, height=160)


def test_aspect_ratio_field():
    assert (ok(aspect_ratio="16:9").height, ok(aspect_ratio="16:9").width) == (768, 1344)
    assert (ok(aspect_ratio="9:16").height, ok(aspect_ratio="9:16").width) == (1344, 768)
    assert (ok(aspect_ratio="4:1").height, ok(aspect_ratio="4:1").width) == (512, 2016)
    bad("aspect_ratio", aspect_ratio="4.01:1")
    bad("aspect_ratio", aspect_ratio="1:4.01")
    bad("aspect_ratio", aspect_ratio="wide")
    bad("aspect_ratio", aspect_ratio="16:9", width=64, height=32)


@pytest.mark.parametrize(
    "aspect, hw", [((16, 9), (768, 1344)), ((1, 1), (768, 768)), ((4, 3), (768, 1024)), ((21, 9), (672, 1536))]
)
def test_canvas_table(aspect, hw):
    assert geometry.resolve_canvas_size(*aspect, 768, 1032192) == hw


def test_canvas_follows_checkpoint_defaults():
    plan = validate(GenerationRequest(prompt="x"), ModelDefaults(canvas_short_edge=64, canvas_max_pixels=8192))
    assert (plan.height, plan.width) == (64, 128)


def test_prompt_limits():
    assert ok(prompt="x" * 7000).prompt == "x" * 7000
    assert "7001" in bad("prompt", prompt="x" * 7001)
    assert "empty" in bad("prompt", prompt="")
    bad("prompt", prompt="   \n")


def test_steps_limits():
    assert ok(steps=1).steps == 1
    bad("steps", steps=0)
    assert ok(steps=200).steps == 200
    bad("steps", steps=201)
    bad("steps", steps=2.5)
    bad("steps", steps=True)


def test_seed_and_shift_limits():
    assert ok(seed=0).seed == 0
    bad("seed", seed=-1)
    assert ok(seed=2**63 - 1).seed == 2**63 - 1
    bad("seed", seed=2**63)
    assert ok(flow_shift=0.5).flow_shift == 0.5
    bad("flow_shift", flow_shift=0)
    assert ok(flow_shift=100).flow_shift == 100.0
    assert "at most 100" in bad("flow_shift", flow_shift=100.01)
    assert ok(audio_flow_shift=100).audio_flow_shift == 100.0
    bad("audio_flow_shift", audio_flow_shift=1e6)
    bad("audio_flow_shift", audio_flow_shift=-1.0)
    assert ok().flow_shift == 12.0 and ok().audio_flow_shift == 3.0


def test_plan_derived_sizes():
    p = ok(width=1344, height=768, duration_s=5)
    assert (p.latent_frames, p.latent_height, p.latent_width, p.audio_latents) == (37, 48, 84, 207)
    assert geometry.latent_frames(345) == 102 and geometry.audio_latents(345) == 575


def _ref(name: str, kind=None):
    from pathlib import Path

    from h3serve.request import MediaRef

    return MediaRef(path=Path(f"/tmp/{name}"), name=name, kind=kind)


def test_task_inference():
    assert ok().task == "t2va"
    assert ok(image=_ref("a.png")).task == "fl2va"
    assert ok(last_image=_ref("b.png")).anchors == ("last",)
    assert ok(image=_ref("a.png"), last_image=_ref("b.png")).anchors == ("first", "last")
    assert ok(references=(_ref("c.png"),)).task == "ref2va"


def test_task_contradictions_are_refused():
    assert "ref2va needs" in bad("task", task="ref2va")
    assert "fl2va needs" in bad("task", task="fl2va")
    assert "t2va does not take keyframes" in bad("task", task="t2va", image=_ref("a.png"))
    assert "fl2va does not take references" in bad("task", task="fl2va", references=(_ref("c.png"),))
    bad("task", task="i2v")
    bad("references", image=_ref("a.png"), references=(_ref("c.png"),))


def test_keyframe_aspect_sets_the_canvas():
    req = GenerationRequest(prompt="x", image=_ref("a.png"))
    assert (validate(req, keyframe_size=(1024, 1024)).height, validate(req, keyframe_size=(1024, 1024)).width) == (
        768,
        768,
    )
    portrait = validate(req, keyframe_size=(720, 1280))
    assert (portrait.height, portrait.width) == (1344, 768)
    sized = validate(GenerationRequest(prompt="x", image=_ref("a.png"), width=512, height=256), keyframe_size=(9, 16))
    assert (sized.width, sized.height) == (512, 256)
    # T2VA ignores a keyframe size: the canvas stays 16:9.
    assert validate(GenerationRequest(prompt="x"), keyframe_size=(9, 16)).width == 1344
