"""The prompt cache: an LRU bounded in bytes, keyed by the encoder, its dtype, the presentation's tokens and the
vision inputs; a repeated prompt skips the text encoder (no `text_encode` stage) and its states, so the outputs, are
byte-identical to those without a cache (a seed sweep, a keyframe request)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from PIL import Image

from h3serve.model.pipeline_types import Conditioning, StageClock
from h3serve.model.prompt_cache import PromptCache, PromptKey, vision_digest
from h3serve.rules.request import GenerationRequest
from h3serve.rules.validate import validate

BASE = GenerationRequest(prompt="a red ball moving left", width=64, height=32, duration_s=4, steps=2, seed=3)


def _key(ids=(1, 2, 3), dtype="torch.float32", encoder="qwen:50", vision=b"") -> PromptKey:
    return PromptKey(encoder, dtype, tuple(ids), vision)


def test_an_lru_bounded_in_bytes_that_returns_copies():
    states = {n: torch.full((1, n, 4), float(n)) for n in (2, 3, 5)}  # 32, 48 and 80 bytes
    cache = PromptCache(limit_bytes=130)
    for n, t in states.items():
        cache.put(_key([n]), t)
    assert len(cache) == 2 and cache.nbytes == 128  # the oldest (2 tokens) went to make room for the 5
    assert cache.get(_key([2]), torch.device("cpu")) is None
    got = cache.get(_key([3]), torch.device("cpu"))
    assert torch.equal(got, states[3]) and got.data_ptr() != states[3].data_ptr()
    got.fill_(0)  # a caller changing its copy changes nothing stored
    assert torch.equal(cache.get(_key([3]), torch.device("cpu")), states[3])
    states[5].fill_(-1)  # nor does the encoder's own tensor, changed after the put
    assert cache.get(_key([5]), torch.device("cpu")).min() == 5
    cache.put(_key([2]), states[2])  # the 5 was used last: the 3 leaves
    assert cache.get(_key([3]), torch.device("cpu")) is None and len(cache) == 2
    cache.put(_key([9]), torch.zeros(1, 9, 4))  # 144 bytes: more than the whole bound, not kept
    assert cache.get(_key([9]), torch.device("cpu")) is None
    assert (cache.hits, cache.misses) == (3, 3)
    cache.clear()
    assert len(cache) == 0 and cache.nbytes == 0


def test_the_key_tells_encoders_dtypes_and_vision_inputs_apart():
    pixels = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    same = vision_digest({"pixel_values": pixels.clone(), "image_grid_thw": torch.tensor([[1, 2, 2]])})
    assert same == vision_digest({"image_grid_thw": torch.tensor([[1, 2, 2]]), "pixel_values": pixels})
    other = pixels.clone()
    other[2, 3] += 1e-3
    assert vision_digest({"pixel_values": other, "image_grid_thw": torch.tensor([[1, 2, 2]])}) != same
    assert vision_digest({"pixel_values": pixels.reshape(4, 3)}) != vision_digest({"pixel_values": pixels})
    assert vision_digest({}) == vision_digest(None) == b""
    cache = PromptCache(limit_bytes=1 << 20)
    cache.put(_key(), torch.ones(1, 3, 4))
    for key in (_key(dtype="torch.bfloat16"), _key(encoder="qwen:49"), _key(vision=same), _key(ids=(1, 2))):
        assert cache.get(key, torch.device("cpu")) is None


@pytest.fixture
def cached_pipeline(tiny_pipeline):
    """The session's pipeline with a prompt cache for the test (and without one after it)."""
    pipeline, defaults = tiny_pipeline
    text = pipeline.components.text
    cache = PromptCache(limit_bytes=1 << 20)
    text.cache = cache
    try:
        yield pipeline, defaults, cache
    finally:
        text.cache = None


def _encoded(pipeline, plan, cond=None):
    """The plan's text states and the stages its encode ran."""
    clock = StageClock(torch.device("cpu"))
    return pipeline.encode(plan, cond or Conditioning(), clock).text_states, set(clock.durations)


def test_a_repeated_prompt_skips_the_encoder_and_the_output_is_byte_identical(cached_pipeline):
    pipeline, defaults, cache = cached_pipeline
    sweep = [validate(dataclasses.replace(BASE, seed=s), defaults) for s in (3, 4, 5)]
    states = [_encoded(pipeline, plan) for plan in sweep]
    assert (cache.misses, cache.hits, len(cache)) == (1, 2, 1)
    assert "text_encode" in states[0][1] and all("text_encode" not in stages for _, stages in states[1:])
    got = pipeline.generate(validate(dataclasses.replace(BASE, seed=6), defaults))
    assert cache.misses == 1 and "text_encode" not in got.stage_durations  # the encoder neither ran nor was placed
    pipeline.components.text.cache = None
    uncached, _ = _encoded(pipeline, sweep[0])
    assert all(torch.equal(s, uncached) for s, _ in states)
    want = pipeline.generate(validate(dataclasses.replace(BASE, seed=6), defaults))
    assert torch.equal(got.video, want.video) and torch.equal(got.audio, want.audio)


def test_keyframes_are_part_of_the_key(cached_pipeline):
    pipeline, defaults, cache = cached_pipeline
    plan = validate(dataclasses.replace(BASE, image="first.png"), defaults, keyframe_size=(64, 32))
    red, blue = (Image.new("RGB", (64, 32), color) for color in ((200, 30, 30), (30, 30, 200)))
    states = [_encoded(pipeline, plan, Conditioning(keyframes=[im], anchors=("first",)))[0] for im in (red, blue, red)]
    assert (cache.misses, cache.hits) == (2, 1)
    assert torch.equal(states[0], states[2]) and not torch.equal(states[0], states[1])
