"""Create-request parsing: bracketed keys, field typing and precedence, unknown fields, media routing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fake_executor import TINY_DEFAULTS
from PIL import Image

from h3serve.api.error_envelope import APIError
from h3serve.api.intake.body import RequestBody, _json_object
from h3serve.api.intake.form_keys import BracketError, unflatten
from h3serve.api.intake.generation_request import StoredMedia, media_aliases, place_media
from h3serve.api.intake.json_values import MAX_NESTING
from h3serve.api.intake.read import MediaSource, media_sources, read_request_fields
from h3serve.api.intake.request_model import VideoCreateFields
from h3serve.engine.planning import plan_request
from h3serve.rules.names import TASKS
from h3serve.rules.request import GenerationRequest, MediaRef


def parse(**fields) -> VideoCreateFields:
    """The request model read from a body, its media fields read too (as the routes do)."""
    body = RequestBody(fields)
    parsed = read_request_fields(body)
    media_sources(body)
    parsed.lora_field()
    return parsed


def build_request(parsed: VideoCreateFields, media: list[StoredMedia]) -> GenerationRequest:
    return place_media(parsed.to_request(), media, parsed.frame_indices())


def request_of(**fields) -> GenerationRequest:
    return build_request(parse(**fields), [])


def sources_of(**fields) -> tuple[MediaSource, ...]:
    return media_sources(RequestBody(fields))


def rejected(**fields) -> APIError:
    with pytest.raises(APIError) as e:
        request_of(**fields)
    assert e.value.status == 400
    return e.value


# -- brackets -------------------------------------------------------------------------------------------------


def test_unflatten_rebuilds_what_the_sdk_flattens():
    pairs = [
        ("prompt", "a cat"),
        ("extra_params[task]", "t2va"),
        ("extra_params[target][duration_seconds]", "6"),
        ("extra_params[frame_indices][]", "0"),
        ("extra_params[frame_indices][]", "-1"),
        ("image_reference[][image_url]", "https://a/1.png"),
        ("image_reference[][image_url]", "https://a/2.png"),
        ("tags", "x"),
        ("tags", "y"),
        ("idx[1]", "b"),
        ("idx[0]", "a"),
    ]
    assert unflatten(pairs) == {
        "prompt": "a cat",
        "extra_params": {"task": "t2va", "target": {"duration_seconds": "6"}, "frame_indices": ["0", "-1"]},
        "image_reference": [{"image_url": "https://a/1.png"}, {"image_url": "https://a/2.png"}],
        "tags": ["x", "y"],
        "idx": ["a", "b"],
    }


def test_unflatten_refuses_one_name_with_two_shapes():
    with pytest.raises(BracketError):
        unflatten([("extra_params", "{}"), ("extra_params[task]", "t2va")])


def test_deep_nesting_is_a_400_not_a_recursion_error():
    deep = "[" * 100_000 + "]" * 100_000  # deeper than json.loads' stack
    nested = "[" * (MAX_NESTING + 1) + "]" * (MAX_NESTING + 1)  # parses, but is deeper than any valid request
    for text in (deep, nested):
        with pytest.raises(APIError) as e:
            _json_object(f'{{"prompt": "p", "extra_params": {text}}}'.encode())
        assert (e.value.status, e.value.code) == (400, "invalid_json") and "levels deep" in e.value.message
        err = rejected(prompt="p", extra_params=text)  # JSON text in a form field
        assert (err.code, err.param) == ("invalid_json", "extra_params")
    with pytest.raises(BracketError, match="levels deep"):
        unflatten([("extra_params" + "[a]" * 5000, "1")])
    ok = "[" * (MAX_NESTING - 1) + "]" * (MAX_NESTING - 1)
    assert _json_object(f'{{"x": {ok}}}'.encode())["x"] == json.loads(ok)


# -- fields ---------------------------------------------------------------------------------------------------


def test_form_strings_and_json_values_build_the_same_request():
    form = request_of(prompt="a cat", width="128", height="64", seconds="5", num_inference_steps="2",
                      flow_shift="7.5", seed="3", fps="24", extra_params='{"audio_flow_shift": 2.5, "task": "t2va"}')
    json_body = request_of(prompt="a cat", width=128, height=64, seconds=5, num_inference_steps=2, flow_shift=7.5,
                           seed=3, fps=24, extra_params={"audio_flow_shift": 2.5, "task": "t2va"})
    bracketed = request_of(prompt="a cat", width="128", height="64", seconds="5", num_inference_steps="2",
                           flow_shift="7.5", seed="3", fps="24",
                           extra_params={"audio_flow_shift": "2.5", "task": "t2va"})
    expected = GenerationRequest(prompt="a cat", width=128, height=64, duration_s=5.0, steps=2, flow_shift=7.5,
                                 seed=3, audio_flow_shift=2.5, task="t2va")
    assert form == json_body == bracketed == expected


def test_extra_params_win_over_top_level_fields_as_in_vllm_omni():
    assert request_of(prompt="p", seconds="4", extra_params={"duration": 6}).duration_s == 6
    both = {"duration": 6, "duration_seconds": 7, "target": {"duration_seconds": 8}}
    assert request_of(prompt="p", seconds="4", extra_params=both).duration_s == 8
    assert request_of(prompt="p", flow_shift="5", extra_params={"flow_shift": 9}).flow_shift == 9
    assert request_of(prompt="p", aspect_ratio="1:1", extra_params={"aspect_ratio": "9:16"}).aspect_ratio == "9:16"


def test_canvas_fields_as_vllm_omni_clients_send_them():
    """short_edge (top level, extra_params, target), numeric ratios as JSON numbers or text, auto (the values'
    rule is h3serve/rules/canvas.py); short_edge used to be refused as unsupported."""
    both = request_of(prompt="p", width="1344", height="768", extra_params={"aspect_ratio": "16:9", "short_edge": 768})
    assert (both.width, both.height, both.aspect_ratio, both.short_edge) == (1344, 768, "16:9", 768)
    assert request_of(prompt="p", extra_params={"target": {"short_edge": 1440}}).short_edge == 1440
    assert request_of(prompt="p", short_edge="768").short_edge == 768
    assert request_of(prompt="p", extra_params={"aspect_ratio": 1.7778}).aspect_ratio == "1.7778"
    assert request_of(prompt="p", aspect_ratio="1.7778").aspect_ratio == "1.7778"
    assert request_of(prompt="p", extra_params={"aspect_ratio": "auto"}).aspect_ratio == "auto"
    assert rejected(prompt="p", aspect_ratio="wide").param == "aspect_ratio"


def test_size_sets_width_and_height_and_names_itself_in_errors():
    parsed = parse(prompt="p", size="1344x768")
    assert (parsed.to_request().width, parsed.to_request().height) == (1344, 768)
    assert parsed.client_names()["width"] == parsed.client_names()["height"] == "size"
    assert rejected(prompt="p", size="big").param == "size"


def test_seconds_label_is_kept_as_sent():
    assert parse(prompt="p", seconds="8").seconds_label() == "8"
    assert parse(prompt="p", seconds="4.0").seconds_label() == "4.0"
    assert parse(prompt="p", extra_params={"duration": 4.5}).seconds_label() == "4.5"
    assert parse(prompt="p").seconds_label() is None


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"seed": "abc"}, "seed"),
        ({"width": "1.5", "height": "64"}, "width"),
        ({"fps": "30"}, "fps"),
        ({"num_outputs_per_prompt": "11"}, "num_outputs_per_prompt"),
        ({"n": "0"}, "n"),
        ({"extra_params": "{not json"}, "extra_params"),
        ({"extra_params": "[1, 2]"}, "extra_params"),
        ({"seconds": ["4", "5"]}, "seconds"),
        ({"flow_shift": "nan"}, "flow_shift"),
    ],
)
def test_ill_typed_values_are_400_naming_the_field(fields, param):
    assert rejected(prompt="p", **fields).param == param


def test_a_json_null_is_not_given_for_options_and_refused_for_values():
    assert request_of(prompt="p", seconds=None, aspect_ratio=None, long_video=None) == GenerationRequest(prompt="p")
    error = rejected(prompt="p", seed=None)
    assert (error.param, error.message) == ("seed", "seed: must be an integer, got None")
    assert rejected(prompt="p", extra_params={"task": None}).param == "extra_params.task"
    assert request_of(prompt="p", size="128x64", width=None).width == 128


def test_missing_prompt():
    assert rejected(seconds="4").param == "prompt"


def test_unknown_fields_are_named():
    err = rejected(prompt="p", colour="red", zoom="2")
    assert err.code == "unknown_field" and "colour, zoom" in err.message
    err = rejected(prompt="p", extra_params={"task": "t2va", "sliding_window": True})
    assert err.param == "extra_params.sliding_window"
    assert rejected(prompt="p", extra_params={"target": {"zoom": 2}}).param == "extra_params.target.zoom"


def test_vllm_fields_without_meaning_here_are_refused_with_the_reason():
    err = rejected(prompt="p", guidance_scale="5", negative_prompt="blurry")
    assert err.code == "unsupported_field" and "guidance-distilled" in err.message
    assert "guidance_scale" in err.message and "negative_prompt" in err.message


# -- media fields and routing ---------------------------------------------------------------------------------


def test_url_reference_forms():
    url = "https://example.com/cat.png"
    for value in ({"image_url": url}, f'{{"image_url": "{url}"}}', url, [{"image_url": url}]):
        media = sources_of(prompt="p", input_reference=value)
        assert [(m.field, m.kind, m.url) for m in media] == [("input_reference", "image", url)]
    media = sources_of(prompt="p", video_reference=[{"video_url": "https://a/1.mp4"}, {"video_url": "https://a/2.mp4"}])
    assert [(m.field, m.kind) for m in media] == [("video_reference[0]", "video"), ("video_reference[1]", "video")]
    assert "file_id" in rejected(prompt="p", image_reference={"file_id": "file_1"}).message
    assert rejected(prompt="p", audio_reference={"image_url": url}).param == "audio_reference"


def test_reference_combinations_follow_vllm_omni():
    url = {"image_url": "https://example.com/a.png"}
    assert rejected(prompt="p", input_reference=url, image_reference=url).param == "input_reference"
    assert rejected(prompt="p", input_references="x").param == "input_references"
    too_many = [{"image_url": f"https://example.com/{i}.png"} for i in range(13)]
    assert rejected(prompt="p", image_reference=too_many).code == "too_many_files"


def _stored(field: str, kind: str | None) -> StoredMedia:
    return StoredMedia(MediaSource(field, None, url="https://x"), MediaRef(Path(f"/data/{field}"), field, None), kind)


def test_input_reference_alone_is_the_first_keyframe():
    keyframe = _stored("input_reference", "image")
    first = build_request(parse(prompt="p"), [keyframe])
    assert (first.image, first.last_image, first.references) == (keyframe.ref, None, ())
    last_only = build_request(parse(prompt="p", extra_params={"frame_index": -1}), [keyframe])
    assert (last_only.image, last_only.last_image) == (None, keyframe.ref)
    assert media_aliases(last_only, [keyframe]) == {"last_image": "input_reference"}
    as_reference = build_request(parse(prompt="p", extra_params={"task": "ref2va"}), [keyframe])
    assert (as_reference.image, as_reference.references) == (None, (keyframe.ref,))


def test_fl2va_task_makes_reference_images_keyframes_placed_by_frame_indices():
    first, second = _stored("image_reference[0]", "image"), _stored("image_reference[1]", "image")
    two = build_request(parse(prompt="p", extra_params={"task": "fl2va"}), [first, second])
    assert (two.image, two.last_image, two.references) == (first.ref, second.ref, ())
    with pytest.raises(APIError, match="frame_indices"):
        build_request(parse(prompt="p", extra_params={"task": "fl2va", "frame_indices": [0, 0]}), [first, second])


def test_reference_images_without_a_task_are_ref2va_references(tmp_path):
    images = []
    for i in range(3):
        Image.new("RGB", (256, 256), (40 * i, 90, 200)).save(tmp_path / f"{i}.png")
        source = MediaSource(f"image_reference[{i}]", "image", url=f"https://a/{i}.png")
        images.append(StoredMedia(source, MediaRef(tmp_path / f"{i}.png", f"{i}.png", "image"), "image"))
    request = build_request(parse(prompt="p"), images)
    assert (request.image, request.references) == (None, tuple(m.ref for m in images))
    assert plan_request(request, TINY_DEFAULTS, TASKS).task == "ref2va"
    with pytest.raises(APIError, match="only fl2va"):  # frame indices place keyframes, and these are not
        build_request(parse(prompt="p", extra_params={"frame_indices": [0, -1]}), images[:2])


def test_input_reference_is_one_file_in_every_form():
    urls = [{"image_url": "https://a/1.png"}, {"image_url": "https://a/2.png"}]
    assert rejected(prompt="p", input_reference=urls).param == "input_reference"


def test_files_of_the_reference_fields_are_references():
    image, video = _stored("input_references[0]", "image"), _stored("input_references[1]", "video")
    mixed = build_request(parse(prompt="p"), [image, video])
    assert (mixed.image, mixed.references) == (None, (image.ref, video.ref))
    assert media_aliases(mixed, [image, video]) == {"references[0]": "input_references[0]",
                                                    "references[1]": "input_references[1]"}
    explicit = build_request(parse(prompt="p", extra_params={"task": "ref2va"}), [image])
    assert explicit.references == (image.ref,) and explicit.task == "ref2va"
    with pytest.raises(APIError, match="fl2va takes images only"):
        build_request(parse(prompt="p", extra_params={"task": "fl2va"}), [image, video])


def test_quality_selects_the_cache_policy_and_is_checked_by_the_schema():
    assert request_of(prompt="a cat", quality="lossless").quality == "lossless"
    assert request_of(prompt="a cat", quality="high").quality == "high"
    assert request_of(prompt="a cat").quality is None  # the server's own setting
    error = rejected(prompt="a cat", quality="ultra")
    assert error.param == "quality" and "'lossless' or 'high'" in str(error)


def test_sample_solver_in_extra_params_any_case_in_json_forms_and_brackets():
    """extra_params.sample_solver: euler or res_multistep, case-insensitive and trimmed (as vLLM-Omni reads it)."""
    assert request_of(prompt="p").sample_solver is None
    for extra in ({"sample_solver": " RES_Multistep "}, json.dumps({"sample_solver": "res_multistep"})):
        request = request_of(prompt="p", extra_params=extra)
        assert plan_request(request, TINY_DEFAULTS).sample_solver == "res_multistep"
    bracketed = request_of(**unflatten([("prompt", "p"), ("extra_params[sample_solver]", "EULER")]))
    assert plan_request(bracketed, TINY_DEFAULTS).sample_solver == "euler"
    for bad, message in (("heun", "must look like euler or res_multistep (any case), got 'heun'"),
                         (3, "got 3"), ("", "got ''")):
        error = rejected(prompt="p", extra_params={"sample_solver": bad})
        assert error.param == "extra_params.sample_solver" and message in error.message, error.message
    assert rejected(prompt="p", sample_solver="euler").param == "sample_solver"  # extra_params only, as vLLM-Omni


def test_force_refresh_in_extra_params_is_an_integer_and_a_policy():
    request = request_of(prompt="p", quality="high", extra_params=json.dumps(
        {"force_refresh_step_hint": 3, "force_refresh_step_policy": "repeat"}))
    assert (request.force_refresh_step_hint, request.force_refresh_step_policy) == (3, "repeat")
    assert plan_request(request, TINY_DEFAULTS).force_refresh.hint == 3
    # vLLM-Omni's strict int, 1 and up; 3.0 is the integer 3 to JSON Schema (and to the published schema), so it is
    # read as 3 (more lenient than vLLM-Omni, which no client of it notices).
    assert request_of(prompt="p", extra_params={"force_refresh_step_hint": 3.0}).force_refresh_step_hint == 3
    for bad in ("3", 3.5, True, 0):
        assert rejected(prompt="p", extra_params={"force_refresh_step_hint": bad}).param == \
            "extra_params.force_refresh_step_hint"
    assert rejected(prompt="p", extra_params={"force_refresh_step_policy": "always"}).param == \
        "extra_params.force_refresh_step_policy"


# -- long video options ---------------------------------------------------------------------------------------


def test_long_video_fields_from_form_strings_json_and_extra_params():
    request = request_of(prompt="p", seconds="40", long_video="true", long_video_mode="continuation",
                         continuation_window_frames="345", continuation_prompts='["a", "b", "c", "d"]')
    assert (request.long_video, request.long_video_mode, request.duration_s) == (True, "continuation", 40.0)
    assert request.continuation_window_frames == 345 and request.continuation_prompts == ("a", "b", "c", "d")
    request = request_of(prompt="p", long_video="false", extra_params=json.dumps(
        {"long_video": True, "continuation_prompts": ["one"], "continuation_overlap_frames": 39}))
    assert (request.long_video, request.continuation_prompts, request.continuation_overlap_frames) == (
        True, ("one",), 39)
    assert request_of(prompt="p", continuation_prompts="just one").continuation_prompts == ("just one",)
    plan = plan_request(request_of(prompt="p", seconds="30", long_video="true"), TINY_DEFAULTS)
    assert (plan.long_video_mode, plan.num_frames) == ("full", 736)


def test_long_video_field_errors_name_the_field():
    assert rejected(prompt="p", long_video="maybe").param == "long_video"
    assert rejected(prompt="p", long_video_mode="sliding").param == "long_video_mode"
    error = rejected(prompt="p", continuation_window_frames="400")
    assert error.param == "continuation_window_frames" and "between 107 and 345" in error.message
    assert rejected(prompt="p", seconds="301").param == "seconds"
    assert rejected(prompt="p", extra_params='{"continuation_prompts": "[1"}').param == "continuation_prompts"


# -- latent-mask editing fields -------------------------------------------------------------------------------


def test_masks_from_json_text_values_and_uploads():
    import io

    from starlette.datastructures import UploadFile

    request = request_of(prompt="p", video_noise_mask="[[0.5, 1]]", audio_mode="lock_source")
    assert request.video_noise_mask == [[0.5, 1]] and request.audio_mode == "lock_source"
    assert request_of(prompt="p", extra_params={"audio_mode": "native"}).audio_mode == "native"
    assert request_of(prompt="p", audio_noise_mask=[0, 0.5]).audio_noise_mask == [0, 0.5]
    upload = UploadFile(io.BytesIO(b"0.25"), size=4, filename="mask.json")
    body = RequestBody({"prompt": "p"}, {"video_noise_mask": [upload]})
    assert read_request_fields(body).to_request().video_noise_mask == 0.25


def test_mask_and_audio_mode_errors_name_the_field():
    error = rejected(prompt="p", video_noise_mask="[" * 70 + "]" * 70)
    assert error.param == "video_noise_mask" and "nested too deeply" in error.message
    assert "must not be null" in rejected(prompt="p", audio_noise_mask="null").message
    assert rejected(prompt="p", audio_mode="loop").param == "audio_mode"


def test_sources_are_routed_to_their_fields_not_the_references(tmp_path):
    video = MediaRef(tmp_path / "s.mp4", "s.mp4", "video")
    image = MediaRef(tmp_path / "r.png", "r.png", "image")
    media = [
        StoredMedia(MediaSource("source_video", "video"), video, "video"),
        StoredMedia(MediaSource("image_reference", "image"), image, "image"),
    ]
    request = build_request(parse(prompt="p", video_noise_mask="0.5"), media)
    assert request.source_video is video and request.references == (image,)
    assert media_aliases(request, media)["source_video"] == "source_video"


def test_list_options_as_json_lists_repeated_fields_and_sdk_brackets():
    assert request_of(prompt="p", continuation_prompts=["a", "b"]).continuation_prompts == ("a", "b")
    pairs = [("prompt", "p"), ("start_time_seconds[]", "1.5"), ("start_time_seconds[]", "0")]
    assert read_request_fields(RequestBody(unflatten(pairs))).to_request().start_time_seconds == (1.5, 0.0)
    assert request_of(prompt="p", start_time_seconds="2").start_time_seconds == 2.0
    assert rejected(prompt="p", start_time_seconds="-1").param == "start_time_seconds"


# -- vLLM-Omni's pre-encode fields ----------------------------------------------------------------------------


def test_preencode_fields_as_vllm_omni_sends_them():
    request = request_of(prompt="p", extra_params={"preencode_mp4": True, "preencode_batch_frames": 34,
                                                   "video_codec_options": {"preset": "ultrafast", "crf": 20}})
    assert (request.preencode_mp4, request.preencode_batch_frames, request.video_preset, request.video_crf) == (
        True, 34, "ultrafast", 20)
    plan = plan_request(request, TINY_DEFAULTS)
    assert (plan.preencode_batch_frames, plan.video_preset, plan.video_crf) == (34, "ultrafast", 20)
    # Enabled without a batch: vLLM-Omni's 17 (one VAE clip); not enabled: each clip as it comes.
    assert plan_request(request_of(prompt="p", extra_params={"preencode_mp4": True}), TINY_DEFAULTS
                        ).preencode_batch_frames == 17
    assert plan_request(request_of(prompt="p"), TINY_DEFAULTS).preencode_batch_frames == 1
    # JSON Schema's integer includes 34.0 (the fixed-seed schema fuzz sent 1.0): read as the int it is.
    request = request_of(prompt="p", extra_params={"preencode_mp4": True, "preencode_batch_frames": 34.0,
                                                   "video_codec_options": {"crf": 20.0},
                                                   "force_refresh_step_hint": 3.0})
    assert (request.preencode_batch_frames, request.video_crf) == (34, 20)
    assert all(type(v) is int for v in (request.preencode_batch_frames, request.video_crf))


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"preencode_mp4": True, "preencode_batch_frames": 0}, "extra_params.preencode_batch_frames"),
        ({"preencode_mp4": True, "preencode_batch_frames": -3}, "extra_params.preencode_batch_frames"),
        ({"preencode_mp4": True, "preencode_batch_frames": 1.5}, "extra_params.preencode_batch_frames"),
        ({"preencode_mp4": True, "preencode_batch_frames": True}, "extra_params.preencode_batch_frames"),
        ({"preencode_mp4": True, "preencode_batch_frames": "17"}, "extra_params.preencode_batch_frames"),
        ({"preencode_mp4": "yes"}, "extra_params.preencode_mp4"),
        ({"video_codec_options": {"preset": "warp"}}, "extra_params.video_codec_options.preset"),
        ({"video_codec_options": {"crf": 52}}, "extra_params.video_codec_options.crf"),
        ({"video_codec_options": {"tune": "film"}}, "extra_params.video_codec_options.tune"),
    ],
)
def test_bad_preencode_fields_are_400_naming_them(extra, param):
    assert rejected(prompt="p", extra_params=extra).param == param
