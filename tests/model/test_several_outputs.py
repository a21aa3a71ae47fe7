"""Several outputs of one prompt (num_outputs_per_prompt): output i is exactly the single request at seed + i, whether
the outputs denoise as one batch or one after another, decoded whole or streamed; progress counts all of them."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from h3serve.media.mp4 import EncoderOptions, write_mp4
from h3serve.media.sink import Mp4Sink, indexed_path
from h3serve.model.pipeline import H3Pipeline
from h3serve.rules.request import GenerationRequest
from h3serve.rules.validate import RequestError, validate

BASE = GenerationRequest(prompt="a red ball moving left", width=64, height=32, duration_s=4, steps=3, seed=11)


class _Frames:
    """A FrameSink that keeps what it is given, and one per further output."""

    def __init__(self) -> None:
        self.frames: list[np.ndarray] = []
        self.audio: np.ndarray | None = None
        self.more: dict[int, _Frames] = {}

    def open(self, num_frames, height, width, audio):
        from contextlib import nullcontext

        self.audio = audio
        return nullcontext(self.frames)

    def for_output(self, index: int) -> _Frames:
        return self.more.setdefault(index, _Frames())


class _Append(list):
    on_device = False
    span = None

    def write(self, frames: np.ndarray) -> None:
        self.append(frames.copy())


@pytest.fixture(scope="module")
def singles(tiny_pipeline):
    """Outputs 0..2 as three single requests (seeds 11, 12, 13)."""
    loaded, defaults = tiny_pipeline
    return [loaded.generate(validate(dataclasses.replace(BASE, seed=11 + i), defaults)) for i in range(3)]


@pytest.mark.parametrize("batch", [1, 2, 3])
def test_each_output_is_its_single_request(tiny_pipeline, singles, batch):
    """Batches of 1, 2 (2 + 1) and 3: bit-identical to the single requests on this CPU."""
    loaded, defaults = tiny_pipeline
    pipeline = H3Pipeline(loaded.components, output_batch=batch)
    seen: list[tuple[int, int]] = []
    plan = validate(dataclasses.replace(BASE, num_outputs=3), defaults)
    result = pipeline.generate(plan, on_step=lambda done, total: seen.append((done, total)))
    outputs = [result, *result.others]
    assert len(outputs) == 3
    for got, want in zip(outputs, singles, strict=True):
        assert torch.equal(got.video, want.video) and torch.equal(got.audio, want.audio)
    assert outputs[0].video is not None and not torch.equal(outputs[0].video, outputs[1].video)
    # One count over every output's forwards, rising to its end.
    assert {total for _, total in seen} == {plan.progress_forwards} == {9}
    assert [done for done, _ in seen] == sorted(done for done, _ in seen) and seen[-1][0] == 9


def _streaming_sink() -> _Frames:
    sink = _Frames()
    sink.frames = _Append()
    return sink


def test_streamed_outputs_go_to_their_own_sinks(tiny_pipeline):
    loaded, defaults = tiny_pipeline
    singles = []
    for i in range(3):
        singles.append(_streaming_sink())
        loaded.generate(validate(dataclasses.replace(BASE, seed=11 + i), defaults), sink=singles[-1])
    sink = _streaming_sink()
    for i in (1, 2):
        sink.more[i] = _streaming_sink()
    H3Pipeline(loaded.components, output_batch=2).generate(
        validate(dataclasses.replace(BASE, num_outputs=3), defaults), sink=sink
    )
    for i, want in enumerate(singles):
        got = sink if i == 0 else sink.more[i]
        assert np.array_equal(np.concatenate(got.frames), np.concatenate(want.frames))
        assert np.array_equal(got.audio, want.audio)


def test_several_outputs_stream_the_mp4s_their_whole_decodes_write(tiny_pipeline, singles, tmp_path):
    """Each output's MP4 (two, one DiT batch), encoded on the encoder's thread while its clips decode, holds the
    bytes `write_mp4` gives its whole decode (the single request at its seed)."""
    loaded, defaults = tiny_pipeline
    fast = EncoderOptions(preset="ultrafast", threads=1)
    sink = Mp4Sink(tmp_path / "out.mp4", fast, previews=True)
    H3Pipeline(loaded.components, output_batch=2).generate(
        validate(dataclasses.replace(BASE, num_outputs=2), defaults), sink=sink
    )
    for i, want in enumerate(singles[:2]):
        write_mp4(tmp_path / f"whole{i}.mp4", want.video.numpy(), want.audio.numpy(), options=fast)
        assert (tmp_path / f"whole{i}.mp4").read_bytes() == indexed_path(tmp_path / "out.mp4", i).read_bytes(), i
    assert [set(files) for files in sink.outputs()] == [{"video", "thumbnail", "spritesheet"}] * 2


def test_the_outputs_count_is_checked():
    for bad in (0, 11, True, 2.0):
        with pytest.raises(RequestError, match="num_outputs"):
            validate(dataclasses.replace(BASE, num_outputs=bad))
    with pytest.raises(RequestError, match="largest seed"):
        validate(dataclasses.replace(BASE, num_outputs=3, seed=2**63 - 2))
    plan = validate(dataclasses.replace(BASE, num_outputs=10))
    assert plan.output(9).seed == 20 and plan.output(9).num_outputs == 1
