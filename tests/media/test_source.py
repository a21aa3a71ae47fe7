"""Edit sources: decoded only as far as the output needs, stretched to the canvas, padded with the last frame."""

from __future__ import annotations

import numpy as np
import pytest

from h3serve.media.media_inputs import MediaFormatError
from h3serve.media.mp4 import write_mp4
from h3serve.media.source import check_source, load_source_audio, load_source_video
from h3serve.rules.request import MediaRef


@pytest.fixture(scope="module")
def clip(tmp_path_factory):
    """A 2 s 12 fps 64x48 MP4 whose frame i is uniformly grey level 10·i, with a 440 Hz soundtrack."""
    path = tmp_path_factory.mktemp("source") / "clip.mp4"
    frames = np.arange(24, dtype=np.float32)[:, None, None, None] * 10 / 255 * np.ones((24, 48, 64, 3))
    t = np.arange(64_000) / 32_000
    audio = np.stack([np.sin(2 * np.pi * 440 * t)] * 2).astype(np.float32) * 0.5
    write_mp4(path, frames.astype(np.float32), audio, fps=12)
    return MediaRef(path, "clip.mp4", "video")


def test_source_video_held_to_24_fps_stretched_and_padded(clip):
    frames, audio = load_source_video(clip, "source_video", 107, 32, 32, with_audio=True)
    assert frames.shape == (107, 32, 32, 3)
    levels = frames[:, 16, 16, 0].astype(int)
    assert abs(levels[0] - 0) <= 3 and abs(levels[2] - 10) <= 3  # each 12 fps frame held for two 24 fps slots
    assert levels[1] == levels[0] and np.all(frames[48:] == frames[47])  # 2 s = 48 frames, then the last held
    assert audio.shape[0] == 2 and 64_000 <= audio.shape[1] <= 65_536  # all 2 s (+ AAC padding) of a 4.46 s output
    frames, audio = load_source_video(clip, "source_video", 22, 32, 64, with_audio=False)
    assert frames.shape == (22, 64, 32, 3) and audio is None


def test_source_audio_is_cut_at_the_output_duration(clip, tmp_path):
    from scipy.io import wavfile

    path = tmp_path / "a.wav"
    wavfile.write(path, 16_000, (np.random.default_rng(0).uniform(-1, 1, 16_000 * 3) * 3e4).astype(np.int16))
    samples = load_source_audio(MediaRef(path, "a.wav"), "source_audio", 2.0)
    assert samples.shape == (2, 64_000) and samples.dtype == np.float32
    with pytest.raises(MediaFormatError, match="expected a source audio, got a video file"):
        check_source(clip, "source_audio", "audio")

