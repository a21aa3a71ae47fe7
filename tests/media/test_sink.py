"""Mp4Sink (a streamed decode's files) against write_artifacts on whole arrays: same MP4 and preview bytes."""

from __future__ import annotations

import numpy as np
import pytest

from h3serve.engine.artifacts import write_artifacts
from h3serve.media.mp4 import EncoderOptions, rgb8
from h3serve.media.previews import VARIANTS
from h3serve.media.sink import DiscardSink, Mp4Sink
from h3serve.messages import GenerationOutput

FAST = EncoderOptions(preset="ultrafast", threads=1)


@pytest.fixture(scope="module")
def clip():
    rng = np.random.default_rng(0)
    video = rng.random((39, 32, 48, 3), dtype=np.float32)
    audio = rng.uniform(-0.5, 0.5, (2, 52_000)).astype(np.float32)
    return video, audio


def _stream(sink, video, audio, sizes=(17, 17, 5)) -> None:
    frames = rgb8(video)
    with sink.open(len(video), video.shape[1], video.shape[2], audio) as writer:
        start = 0
        for size in sizes:
            writer.write(frames[start : start + size])
            start += size


def test_streamed_files_equal_the_whole_array_artifacts(clip, tmp_path):
    video, audio = clip
    write_artifacts(tmp_path / "whole", GenerationOutput(video, audio), FAST)
    sink = Mp4Sink(tmp_path / "spool" / "job-1.mp4", FAST, previews=True)
    (tmp_path / "spool").mkdir()
    _stream(sink, video, audio)
    files = sink.files()
    assert set(files) == set(VARIANTS) and len(sink.kept) <= 11  # only the previews' frames were kept
    streamed = GenerationOutput(None, None, files=files, streamed_frames=len(video))
    assert streamed.num_frames == 39
    write_artifacts(tmp_path / "moved", streamed, FAST)
    for variant in VARIANTS.values():
        name = variant.file_name
        assert (tmp_path / "moved" / name).read_bytes() == (tmp_path / "whole" / name).read_bytes(), name
    assert not any((tmp_path / "spool").iterdir())  # moved, not copied


def test_an_incomplete_stream_leaves_no_mp4(clip, tmp_path):
    video, audio = clip
    with pytest.raises(ValueError, match="22 of the announced 39 frames"):
        _stream(Mp4Sink(tmp_path / "x.mp4", FAST), video, audio, sizes=(17, 5))
    with pytest.raises(ValueError, match="more than the announced"):
        with Mp4Sink(tmp_path / "x.mp4", FAST).open(39, 32, 48, audio) as writer:
            for _ in range(3):
                writer.write(rgb8(video[:17]))
    assert list(tmp_path.iterdir()) == []


def test_discard_sink_takes_anything(clip):
    video, audio = clip
    _stream(DiscardSink(), video, audio, sizes=(3,))
