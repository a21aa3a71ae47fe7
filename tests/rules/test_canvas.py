"""The canvas rule (h3serve/rules/canvas.py): vLLM-Omni's canvas fields, their agreement with a size, auto per task."""

from __future__ import annotations

from pathlib import Path

import pytest

from h3serve.rules.request import GenerationRequest, MediaRef
from h3serve.rules.validate import ModelDefaults, RequestError, validate

KEYFRAME = MediaRef(Path("k.png"), "k.png", "image")
REFERENCE = MediaRef(Path("r.png"), "r.png", "image")
RELEASED = ModelDefaults()


def canvas(keyframe_size: tuple[int, int] | None = None, defaults: ModelDefaults = RELEASED, **kw) -> str:
    plan = validate(GenerationRequest(prompt="p", **kw), defaults, keyframe_size)
    return f"{plan.width}x{plan.height}"


def refused(**kw) -> RequestError:
    with pytest.raises(RequestError) as e:
        canvas(**kw)
    return e.value


@pytest.mark.parametrize(
    "ratio, size",
    [("21:9", "1536x672"), ("16:9", "1344x768"), ("4:3", "1024x768"), ("1:1", "768x768"), ("3:4", "768x1024"),
     ("9:16", "768x1344"), ("1.7778", "1344x768"), ("0.5625", "768x1344"), ("2.5:1", "1600x640"), ("16x9", "1344x768")],
)
def test_named_any_and_numeric_ratios(ratio, size):
    assert canvas(aspect_ratio=ratio) == size


def test_a_size_with_a_ratio_that_agrees_after_flooring_is_generated_as_given():
    assert canvas(width=1344, height=768, aspect_ratio="16:9") == "1344x768"  # vLLM-Omni's H3 serving tests
    assert canvas(width=1280, height=704, aspect_ratio="16:9") == "1280x704"  # the SDK's 1280x720, floored
    assert canvas(width=1536, height=672, aspect_ratio="21:9") == "1536x672"  # the model card's own 21:9 canvas
    assert canvas(width=1344, height=768, aspect_ratio="auto") == "1344x768"


def test_a_conflicting_pair_is_refused_naming_both():
    err = refused(width=1024, height=1024, aspect_ratio="16:9")
    assert err.field == "aspect_ratio" and "width/height (size) 1024x1024" in err.message
    assert "1.778" in err.message and "0.9697 to 1.031" in err.message


def test_auto_and_adaptive_per_task():
    assert canvas(keyframe_size=(1000, 1000), image=KEYFRAME, aspect_ratio="auto") == "768x768"  # FL2VA: keyframe
    assert canvas(keyframe_size=(720, 1280), image=KEYFRAME, aspect_ratio="ADAPTIVE") == "768x1344"
    assert canvas(references=(REFERENCE,), aspect_ratio="auto") == "1344x768"  # Ref2VA: 16:9
    assert canvas(aspect_ratio="adaptive") == "1344x768"  # T2VA: the checkpoint's default (vLLM-Omni refuses it)
    tiny = ModelDefaults(canvas_short_edge=64, canvas_max_pixels=64 * 128)
    assert canvas(defaults=tiny, aspect_ratio="auto") == "128x64"


def test_short_edge_modes():
    assert canvas(short_edge=768, aspect_ratio="16:9") == "1344x768"
    assert canvas(short_edge=1440, aspect_ratio="16:9") == "2528x1440"
    assert canvas(short_edge=1440, aspect_ratio="1:1") == "1440x1440"
    assert canvas(short_edge=768, width=1344, height=768) == "1344x768"
    tiny = ModelDefaults(canvas_short_edge=64, canvas_max_pixels=64 * 128)
    assert canvas(defaults=tiny, short_edge=1440, aspect_ratio="16:9") == "224x128"  # the tiny checkpoint's mode
    assert refused(short_edge=1080).field == "short_edge"
    err = refused(short_edge=1440, width=1344, height=768)
    assert err.field == "short_edge" and "1344x768" in err.message and "2528x1440" in err.message


@pytest.mark.parametrize("text", ["wide", "0:9", "16:0", "nan", "1:2:3", ""])
def test_malformed_ratios(text):
    assert "must look like 16:9" in refused(aspect_ratio=text).message


def test_the_cli_reads_the_canvas_fields():
    from h3serve.entrypoints.cli import build_parser
    from h3serve.entrypoints.generate import _request_from_args

    args = build_parser().parse_args(["generate", "x", "-o", "o.mp4", "--short-edge", "1440", "--aspect-ratio", "auto"])
    plan = validate(_request_from_args(args))
    assert (plan.width, plan.height) == (2528, 1440)
