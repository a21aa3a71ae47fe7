"""The whole soundtrack's AAC packets encoded on their own thread (h3serve.media.aac_packets): the same bytes as
the synchronous encode, and an encoder failure reaches the writer."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest

from h3serve.media import mp4
from h3serve.media.mp4 import EncoderOptions, Mp4Writer, audio_samples_for, rgb8

FAST = EncoderOptions(preset="veryfast", threads=1)


def content(frames: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    video = rng.random((frames, 32, 64, 3), dtype=np.float32)
    audio = (0.4 * rng.standard_normal((2, audio_samples_for(frames, 24, 32000) + 300))).astype(np.float32)
    return rgb8(video), audio


def encode(path: Path, frames: np.ndarray, audio: np.ndarray, synchronous: bool, chunk: int = 17) -> str:
    """The MP4's sha256: the soundtrack given whole (threaded), or fed up front through `append_audio` (the
    synchronous per-frame encode, the writer's path before the AAC thread)."""
    given = np.zeros_like(audio) if synchronous else audio
    with Mp4Writer(path, len(frames), 32, 64, given, options=FAST, audio_follows=synchronous) as writer:
        if synchronous:
            writer.append_audio(audio)
        for start in range(0, len(frames), chunk):
            writer.write(frames[start : start + chunk])
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("frames", [1, 43, 107])
def test_the_threaded_soundtrack_gives_the_synchronous_bytes(frames, tmp_path):
    video, audio = content(frames, seed=frames)
    threaded = encode(tmp_path / "threaded.mp4", video, audio, synchronous=False)
    assert threaded == encode(tmp_path / "synchronous.mp4", video, audio, synchronous=True)
    assert threaded == encode(tmp_path / "again.mp4", video, audio, synchronous=False, chunk=5)


def test_an_audio_encoder_failure_reaches_the_writer_and_leaves_no_file(tmp_path, monkeypatch):
    class Broken(mp4.AacPackets):
        def _encode(self) -> None:
            with self._ready:
                self._error = RuntimeError("the AAC encoder failed")
                self._ready.notify_all()

    monkeypatch.setattr(mp4, "AacPackets", Broken)
    video, audio = content(12, seed=0)
    with pytest.raises(RuntimeError, match="the AAC encoder failed"):
        encode(tmp_path / "out.mp4", video, audio, synchronous=False)
    assert list(tmp_path.iterdir()) == []


def test_a_writer_that_fails_stops_the_audio_thread(tmp_path):
    video, audio = content(12, seed=1)
    with pytest.raises(ValueError, match="of the announced"):
        with Mp4Writer(tmp_path / "out.mp4", 12, 32, 64, audio, options=FAST) as writer:
            writer.write(video[:5])
            thread = writer._aac._thread
    assert not thread.is_alive() and list(tmp_path.iterdir()) == []
