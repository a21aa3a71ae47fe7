"""vLLM-Omni's forced DiT-cache refresh (`extra_params.force_refresh_step_hint` / `_policy`): what it means and
when a request may carry it."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from h3serve.rules.cache_refresh import ForceRefresh
from h3serve.rules.defaults import ModelDefaults
from h3serve.rules.request import GenerationRequest, MediaRef
from h3serve.rules.validate import RequestError, validate

TEA, CACHE_DIT = (dataclasses.replace(ModelDefaults(), server_cache=name) for name in ("tea_cache", "cache_dit"))


def _plan(defaults: ModelDefaults = ModelDefaults(), **fields):  # noqa: B008 (frozen)
    return validate(GenerationRequest(prompt="p", duration_s=4, steps=8, **fields), defaults)


def test_once_refreshes_after_the_hint_and_repeat_after_every_multiple():
    assert [f for f in range(10) if ForceRefresh(3).refreshes(f)] == [3]
    assert [f for f in range(10) if ForceRefresh(3, "repeat").refreshes(f)] == [3, 6, 9]
    assert not ForceRefresh(1).refreshes(0)  # the first forward starts fresh anyway


def test_a_refresh_is_planned_wherever_a_dit_cache_runs():
    assert _plan(quality="high", force_refresh_step_hint=4).force_refresh == ForceRefresh(4, "once")
    assert _plan(CACHE_DIT, force_refresh_step_hint=8, force_refresh_step_policy="repeat").force_refresh == \
        ForceRefresh(8, "repeat")
    assert _plan(TEA, force_refresh_step_hint=2).force_refresh == ForceRefresh(2)
    assert _plan(TEA).force_refresh is None


@pytest.mark.parametrize(
    "defaults, fields, field, says",
    [
        (ModelDefaults(), {"force_refresh_step_hint": 2}, "force_refresh_step_hint", "needs a DiT cache active"),
        (TEA, {"force_refresh_step_hint": 2, "quality": "lossless"}, "force_refresh_step_hint", "needs a DiT cache"),
        (TEA, {"force_refresh_step_hint": 2, "task": "ref2va"}, "force_refresh_step_hint", "needs a DiT cache"),
        (TEA, {"force_refresh_step_policy": "once"}, "force_refresh_step_policy", "needs force_refresh_step_hint"),
        (TEA, {"force_refresh_step_hint": 9}, "force_refresh_step_hint", r"between 1 and num_inference_steps \(8\)"),
        (TEA, {"force_refresh_step_hint": 0}, "force_refresh_step_hint", "between 1 and"),
        (TEA, {"force_refresh_step_hint": True}, "force_refresh_step_hint", "must be an integer"),
        (TEA, {"force_refresh_step_hint": 2, "force_refresh_step_policy": "twice"}, "force_refresh_step_policy",
         "must be one of once, repeat"),
    ],
)
def test_refusals_name_the_field_and_the_rule(defaults, fields, field, says):
    if fields.get("task") == "ref2va":
        fields["references"] = (MediaRef(Path("ref.png"), "ref.png", "image"),)
    with pytest.raises(RequestError, match=says) as e:
        _plan(defaults, **fields)
    assert e.value.field == f"extra_params.{field}"
