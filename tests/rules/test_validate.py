"""Request rules: every limit at its edge and just past it."""

from __future__ import annotations

from pathlib import Path

import pytest

from h3serve.rules import geometry
from h3serve.rules.request import GenerationRequest, MediaRef
from h3serve.rules.validate import ModelDefaults, RequestError, validate


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
    # Beside a size it must describe the same canvas (h3serve/rules/canvas.py; it used to be refused outright).
    assert "conflicts with width/height" in bad("aspect_ratio", aspect_ratio="16:9", width=64, height=64)


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

    from h3serve.rules.request import MediaRef

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


# -- long video (h3serve/rules/long_video.py) ------------------------------------------------------------------------


def _cont(**kw):
    return {"long_video": True, "long_video_mode": "continuation", **kw}


def test_long_video_duration_caps():
    assert "long_video=true allows up to 30 s" in bad("duration", duration_s=16)
    full = ok(long_video=True, duration_s=30)
    assert (full.long_video_mode, full.num_frames, full.windows) == ("full", 736, ())
    assert "between 4 and 30 seconds (long_video_mode=full)" in bad("duration", long_video=True, duration_s=30.5)
    assert ok(long_video=True, num_frames=720).num_frames == 736
    assert "long_video_mode=full" in bad("num_frames", long_video=True, num_frames=721)
    plan = ok(**_cont(duration_s=300))
    assert (plan.task, plan.num_frames, len(plan.windows)) == ("ref2va", 7213, 29)
    assert "between 4 and 300 seconds (long_video_mode=continuation)" in bad("duration", **_cont(duration_s=301))
    assert "between 4 and 300" in bad("duration", **_cont(duration_s=3))
    assert ok(long_video=False, duration_s=15).long_video_mode is None


def test_long_video_option_types_and_modes():
    assert "must be a boolean" in bad("long_video", long_video="yes")
    assert "must be full or continuation" in bad("long_video_mode", long_video=True, long_video_mode="sliding")
    assert "needs long_video=true" in bad("long_video_mode", long_video_mode="full")
    msg = bad("long_video_mode", long_video=True, long_video_mode="continuation", task="t2va")
    assert "continuation requires Ref2VA request execution" in msg and "t2va" in msg
    assert "only with long_video=true and long_video_mode=continuation" in bad(
        "continuation_window_frames", long_video=True, continuation_window_frames=277
    )
    assert "only with" in bad("continuation_prompts", continuation_prompts=("a",))


def test_continuation_defaults_and_window_options():
    plan = ok(**_cont(duration_s=40))
    assert [(w.start, w.end) for w in plan.windows] == [(0, 277), (255, 532), (510, 787), (765, 974)]
    assert plan.window_prompts == ("a cat",) * 4 and plan.continuation
    plan = ok(**_cont(duration_s=40, continuation_window_frames=345, continuation_overlap_frames=39))
    assert [w.start for w in plan.windows] == [0, 306, 612, 918]
    for field, value in (("continuation_window_frames", 276), ("continuation_overlap_frames", True),
                         ("continuation_overlap_frames", 0), ("continuation_window_frames", "277")):
        assert "must be an integer on the 17n+5 frame grid" in bad(field, **_cont(**{field: value}))
    assert "must be 107..345 frames and exceed its overlap" in bad(
        "continuation_window_frames", **_cont(continuation_window_frames=362)
    )
    assert "exceed its overlap" in bad("continuation_overlap_frames", **_cont(continuation_overlap_frames=277))
    assert "uncached denoising; set quality=lossless" in bad("quality", **_cont(quality="high"))
    assert ok(**_cont(quality="lossless")).quality == "lossless"


def test_continuation_prompts_one_per_window_main_prompt_kept():
    plan = ok(**_cont(duration_s=40, prompt="a beach", continuation_prompts=("dawn", "noon", "dusk", "night")))
    assert plan.window_prompts == ("a beach dawn", "a beach noon", "a beach dusk", "a beach night")
    assert plan.prompt == "a beach"
    msg = bad("continuation_prompts", **_cont(duration_s=40, continuation_prompts=("a", "b", "c")))
    assert "must contain exactly 4 non-empty strings" in msg
    bad("continuation_prompts", **_cont(duration_s=40, continuation_prompts=("a", "b", " ", "d")))
    long = "x" * 3600
    assert "the limit is 7000" in bad("continuation_prompts[1]", **_cont(
        prompt=long, duration_s=20, continuation_prompts=("a", long)))


# -- latent-mask editing (h3serve/rules/edit_mask.py) -----------------------------------------------------------------

SRC_V, SRC_A = MediaRef(Path("/src.mp4"), "src.mp4", "video"), MediaRef(Path("/src.wav"), "src.wav", "audio")
EDIT = {"width": 64, "height": 32, "duration_s": 4}  # latent grid (32, 2, 4), 178 audio latents


def test_mask_shapes_on_the_latent_grid():
    plan = ok(source_video=SRC_V, video_noise_mask=0.25, **EDIT)
    assert plan.edit and plan.video_mask.shape == (32, 2, 4) and set(plan.video_mask.array().flat) == {0.25}
    tokens = [[[1.0, 0.0]] for _ in range(32)]  # (32, 1, 2) token grid -> upsampled 2x2
    grid = ok(source_video=SRC_V, video_noise_mask=tokens, **EDIT).video_mask.array()
    assert grid[:, :, :2].min() == 1 and grid[:, :, 2:].max() == 0
    flat = ok(source_video=SRC_V, video_noise_mask=[0.5] * 64, **EDIT).video_mask.array()
    assert flat.shape == (32, 2, 4) and flat.min() == 0.5
    full = [[[0.0, 0.5, 1.0, 1.0]] * 2] * 32
    assert ok(source_video=SRC_V, video_noise_mask=[full], **EDIT).video_mask.array()[0, 1, 1] == 0.5  # squeezed
    assert ok(source_video=SRC_V, video_noise_mask=1, **EDIT).video_mask is None  # all-1: dropped
    assert ok(source_audio=SRC_A, audio_noise_mask=[0.0] * 178, **EDIT).audio_mask.shape == (2, 178)
    assert ok(source_audio=SRC_A, audio_noise_mask=[[0.0] * 178, [1.0] * 178], **EDIT).audio_mask.array()[1, 0] == 1
    assert ok(source_video=SRC_V, audio_noise_mask=[0.5] * 356, **EDIT).audio_mask.array()[1, 177] == 0.5


def test_mask_refusals_name_the_field():
    assert "must not contain booleans" in bad("video_noise_mask", source_video=SRC_V, video_noise_mask=[True], **EDIT)
    assert "non-empty and finite" in bad("video_noise_mask", source_video=SRC_V, video_noise_mask=[], **EDIT)
    bad("video_noise_mask", source_video=SRC_V, video_noise_mask=float("nan"), **EDIT)
    assert "values must be in [0, 1]" in bad("audio_noise_mask", source_audio=SRC_A, audio_noise_mask=1.5, **EDIT)
    msg = bad("video_noise_mask", source_video=SRC_V, video_noise_mask=[0.5] * 63, **EDIT)
    assert "shape must be a scalar, (64,) flat, (32, 1, 2) tokens or (32, 2, 4)" in msg and "got (63,)" in msg
    assert "ragged" in bad("video_noise_mask", source_video=SRC_V, video_noise_mask=[[0.1], [0.1, 0.2]], **EDIT)
    assert "(2, 178)" in bad("audio_noise_mask", source_audio=SRC_A, audio_noise_mask=[0.1] * 177, **EDIT)


def test_edit_rules():
    assert "edit sources require video_noise_mask or audio_noise_mask" in bad("source_video", source_video=SRC_V)
    assert "requires an audio_noise_mask" in bad("source_audio", source_audio=SRC_A)
    assert "requires source_video" in bad("video_noise_mask", video_noise_mask=0.5)
    assert "requires source_audio or source_video" in bad("audio_noise_mask", audio_noise_mask=0.5)
    # Continuation edits (issue 20: a long video's remix): the masks are on the whole video's latent grid.
    plan = ok(source_video=SRC_V, video_noise_mask=0.5, long_video=True, long_video_mode="continuation",
              task="ref2va", duration_s=40)
    assert plan.video_mask.shape[0] == plan.latent_frames == 287 and len(plan.windows) == 4
    assert ok(source_video=SRC_V, video_noise_mask=0.5, long_video=True, duration_s=30).video_mask.shape[0] == 217


def test_audio_mode_lock_source():
    assert "must be native or lock_source" in bad("audio_mode", audio_mode="loop")
    plan = ok(audio_mode="lock_source", source_audio=SRC_A, **EDIT)
    assert plan.source_audio == SRC_A and plan.audio_mask.shape == (2, 178) and plan.audio_mask.array().max() == 0
    assert (plan.task, plan.audio_mode, plan.video_mask) == ("t2va", "lock_source", None)
    ref = MediaRef(Path("/drum.wav"), "drum.wav", "audio")
    plan = ok(audio_mode="lock_source", references=(ref,), **EDIT)  # taken out of the references: still t2va
    assert (plan.task, plan.references, plan.source_audio) == ("t2va", (), ref)
    assert "exactly one driving audio" in bad("audio_mode", audio_mode="lock_source")
    assert "exactly one driving audio" in bad("audio_mode", audio_mode="lock_source", source_audio=SRC_A,
                                              references=(ref,))
    assert "cannot be combined with audio latent-mask editing" in bad(
        "audio_noise_mask", audio_mode="lock_source", source_audio=SRC_A, audio_noise_mask=0.5)


def test_extension_plan_source_then_new_part():
    src = MediaRef(Path("/src.mp4"), "src.mp4", "video")
    request = GenerationRequest(prompt="on", extend_video=src, duration_s=4, long_video=True,
                                long_video_mode="continuation", continuation_prompts=("and on",))
    plan = validate(request, extend_frames=150)  # 150 frames -> 141 on the grid, then 102 new frames
    assert (plan.task, plan.num_frames, plan.extend_video) == ("ref2va", 243, src)
    assert [(w.start, w.end) for w in plan.windows] == [(0, 141), (119, 243)]
    assert plan.window_prompts == ("on", "on and on")
    with pytest.raises(RequestError, match="more than the overlap"):
        validate(request, extend_frames=30)
    with pytest.raises(RequestError, match="at most 300 s"):
        validate(GenerationRequest(prompt="x", extend_video=src, duration_s=290, long_video=True,
                                   long_video_mode="continuation"), extend_frames=24 * 20)
    with pytest.raises(RequestError, match="an extension is a continuation"):
        validate(GenerationRequest(prompt="x", extend_video=src), extend_frames=150)


def test_start_time_seconds_only_for_ref2va():
    ref = MediaRef(Path("/r.mp4"), "r.mp4", "video")
    assert ok(references=(ref,), start_time_seconds=1.5).start_times == (1.5,)
    assert ok(references=(ref, ref), start_time_seconds=(0, 2)).start_times == (0.0, 2.0)
    assert "trims Ref2VA reference videos; this request is t2va" in bad("start_time_seconds", start_time_seconds=1)
    assert "must be seconds >= 0" in bad("start_time_seconds", references=(ref,), start_time_seconds=-1)


def test_sample_solver_is_read_case_insensitively_and_refused_by_name():
    assert validate(GenerationRequest(prompt="x")).sample_solver == "euler"
    for sent, solver in (("euler", "euler"), (" RES_Multistep\t", "res_multistep"), ("EULER", "euler")):
        assert validate(GenerationRequest(prompt="x", sample_solver=sent)).sample_solver == solver
    for bad, message in (("heun", "must be one of euler, res_multistep, got 'heun'"), ("", "got ''"),
                         ("res multistep", "got 'res multistep'"), (2, "must be a string")):
        with pytest.raises(RequestError, match=message) as err:
            validate(GenerationRequest(prompt="x", sample_solver=bad))
        assert err.value.field == "sample_solver"


def test_sample_solver_under_a_few_step_adapter_is_euler_only():
    """A Turbo LoRA or a fused FastH3 adapter was distilled for Euler steps on its pinned grid: res_multistep is
    refused naming the field and the adapter; euler (or nothing) runs."""
    import dataclasses

    from h3serve.adapters.fasth3 import POSITIONS
    from h3serve.adapters.turbo import parse_turbo_name
    from h3serve.rules.adapter_choice import AdapterChoice
    from h3serve.rules.schedule import PinnedSchedule

    turbo = AdapterChoice(name="turbo", path="/x.safetensors", scale=1.0, int_id=1, rank=8, alpha=8.0,
                          turbo=parse_turbo_name("minimax_h3_fl2v_turbo_4step_v1.0.safetensors"))
    fused = dataclasses.replace(ModelDefaults(), fused_adapter="fasth3.safetensors", pinned_schedule=PinnedSchedule(
        owner="the fused FastH3 adapter fasth3.safetensors", positions=POSITIONS))
    for request, defaults, owner in (
        (GenerationRequest(prompt="x", lora=turbo), ModelDefaults(), "the 4-step Turbo adapter turbo"),
        (GenerationRequest(prompt="x"), fused, "the fused FastH3 adapter fasth3.safetensors"),
    ):
        assert validate(dataclasses.replace(request, sample_solver="Euler"), defaults).sample_solver == "euler"
        with pytest.raises(RequestError, match=f"{owner}.* with the euler solver only") as err:
            validate(dataclasses.replace(request, sample_solver="res_multistep"), defaults)
        assert err.value.field == "sample_solver"
