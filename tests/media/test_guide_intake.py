"""Timeline guide files (h3serve/media/guide_intake.py): measured before queueing (frames on the 24 fps grid, pixels,
samples) under a server's limits, and decoded for the pipeline (pictures center-cropped to the canvas, clips held to
24 fps, sounds to stereo 32 kHz with mono duplicated)."""

from __future__ import annotations

import wave
from pathlib import Path

import av
import numpy as np
import pytest
from PIL import Image

from h3serve.errors import RequestError
from h3serve.media.guide_intake import load_guide_picture, load_guide_sound, probe_guides
from h3serve.media.media_errors import MediaFormatError, MediaLimitError
from h3serve.rules.guide_limits import GuideLimits
from h3serve.rules.guides import PlacedGuide
from h3serve.rules.request import MediaRef, TimelineGuide

COLORS = [(250, 0, 0), (0, 250, 0), (0, 0, 250), (250, 250, 0), (0, 250, 250), (250, 0, 250)]


def _image(path: Path, size=(200, 100)) -> MediaRef:
    pixels = np.zeros((size[1], size[0], 3), np.uint8)
    pixels[:, : size[0] // 2] = (250, 0, 0)  # left half red, right half blue
    pixels[:, size[0] // 2 :] = (0, 0, 250)
    Image.fromarray(pixels).save(path)
    return MediaRef(path, path.name, "image")


def _clip(path: Path, frames: int, fps: int = 12) -> MediaRef:
    """A clip whose frame i is one flat colour (COLORS[i % 6]), at `fps`."""
    with av.open(str(path), "w") as out:
        stream = out.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
        stream.options = {"crf": "0", "preset": "ultrafast"}
        for i in range(frames):
            rgb = np.zeros((48, 64, 3), np.uint8) + np.array(COLORS[i % 6], np.uint8)
            out.mux(stream.encode(av.VideoFrame.from_ndarray(rgb, format="rgb24")))
        out.mux(stream.encode(None))
    return MediaRef(path, path.name, "video")


def _sound(path: Path, seconds: float = 0.5, rate: int = 16_000) -> MediaRef:
    n = int(seconds * rate)
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes((16000 * np.sin(2 * np.pi * 200 * np.arange(n) / rate)).astype("<i2").tobytes())
    return MediaRef(path, path.name, "audio")


def test_probes_measure_frames_on_the_24fps_grid_pixels_and_samples(tmp_path):
    image, clip, sound = _image(tmp_path / "a.png"), _clip(tmp_path / "c.mp4", 11), _sound(tmp_path / "s.wav")
    probes = probe_guides([TimelineGuide(0, image), TimelineGuide(5, clip, sound)], GuideLimits())
    assert (probes[0].visual_frames, probes[0].source_pixels) == (1, 200 * 100)
    assert (probes[1].visual_frames, probes[1].source_frames, probes[1].source_pixels) == (22, 11, 64 * 48)
    assert (probes[1].audio_samples, probes[1].audio_latents) == (8_000, 20)  # 0.5 s at 16 kHz, 40 latents a second


def test_probe_limits_name_the_entry_and_the_limit(tmp_path):
    image, sound = _image(tmp_path / "a.png"), _sound(tmp_path / "s.wav")
    with pytest.raises(MediaLimitError) as e:
        probe_guides([TimelineGuide(0, image)], GuideLimits(max_source_pixels=200 * 100 - 1))
    assert e.value.field == "timeline_guides[0].image" and "19,999 pixels" in e.value.limit
    with pytest.raises(MediaLimitError, match="audio guides at most"):
        probe_guides([TimelineGuide(0, audio=sound)], GuideLimits(max_audio_bytes=1000))
    size = image.path.stat().st_size
    reused = [TimelineGuide(0, image), TimelineGuide(9, image)]  # one file: its bytes count once
    probe_guides(reused, GuideLimits(max_total_upload_bytes=size, max_unique_files=1))
    other = _image(tmp_path / "b.png")
    with pytest.raises(MediaLimitError, match="2 distinct guide files"):
        probe_guides([*reused, TimelineGuide(3, other)], GuideLimits(max_unique_files=1))
    with pytest.raises(MediaLimitError, match="add up to"):
        probe_guides([*reused, TimelineGuide(3, other)], GuideLimits(max_total_upload_bytes=2 * size - 1))
    with pytest.raises(MediaLimitError, match="longer than the limit"):
        probe_guides([TimelineGuide(0, audio=sound)], GuideLimits(max_decoded_audio_samples=7_999))
    with pytest.raises(RequestError, match="at most 1"):
        probe_guides(reused, GuideLimits(max_entries=1))


def test_a_file_must_be_of_its_entrys_kind_and_format(tmp_path):
    image = _image(tmp_path / "a.png")
    with pytest.raises(MediaFormatError, match="declared as an audio guide"):
        probe_guides([TimelineGuide(0, audio=MediaRef(image.path, "a.png", "audio"))], GuideLimits())
    gif = tmp_path / "a.gif"
    Image.new("RGB", (8, 8)).save(gif)
    with pytest.raises(MediaFormatError, match="unsupported image format GIF"):
        probe_guides([TimelineGuide(0, MediaRef(gif, "a.gif", "image"))], GuideLimits())


def test_a_picture_is_center_cropped_to_the_canvas_aspect(tmp_path):
    image = _image(tmp_path / "a.png")  # 200x100: a 64x64 canvas keeps the middle 100x100
    frames = load_guide_picture(PlacedGuide(0, 1, image), "timeline_guides[0].image", 64, 64)
    assert frames.shape == (1, 64, 64, 3) and frames.dtype == np.uint8
    assert tuple(frames[0, 32, 4]) == (250, 0, 0) and tuple(frames[0, 32, 60]) == (0, 0, 250)
    wide = load_guide_picture(PlacedGuide(0, 1, image), "timeline_guides[0].image", 128, 64)  # same aspect
    assert tuple(wide[0, 32, 10]) == (250, 0, 0) and tuple(wide[0, 32, 120]) == (0, 0, 250)


def test_a_clip_is_held_to_24fps_and_keeps_its_first_g_frames(tmp_path):
    clip = _clip(tmp_path / "c.mp4", 11)  # 12 fps: every frame held twice
    frames = load_guide_picture(PlacedGuide(0, 5, clip), "timeline_guides[0].video", 32, 32)
    assert frames.shape == (5, 32, 32, 3)
    colours = [tuple(int(c) for c in f[16, 16]) for f in frames]
    expected = [COLORS[0], COLORS[0], COLORS[1], COLORS[1], COLORS[2]]
    assert all(max(abs(a - b) for a, b in zip(got, want, strict=True)) <= 6
               for got, want in zip(colours, expected, strict=True)), colours


def test_a_mono_sound_is_duplicated_to_stereo_at_32khz(tmp_path):
    sound = _sound(tmp_path / "s.wav")
    wave_ = load_guide_sound(PlacedGuide(0, 0, audio=sound, audio_latents=20), "timeline_guides[0].audio")
    assert wave_.shape == (2, 16_000) and wave_.dtype == np.float32
    assert np.array_equal(wave_[0], wave_[1])
    assert 0.45 < np.abs(wave_).max() < 0.5  # 16000 / 32768: duplicated, not scaled by 1/sqrt(2)


def test_a_missing_file_is_a_media_error_naming_the_entry(tmp_path):
    from h3serve.media.media_errors import MediaDecodeError

    with pytest.raises(MediaDecodeError) as e:
        probe_guides([TimelineGuide(0, MediaRef(tmp_path / "gone.png", "gone.png", "image"))], GuideLimits())
    assert e.value.field == "timeline_guides[0].image" and "cannot read" in e.value.message
