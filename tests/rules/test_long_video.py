"""Continuation window planning, exact against the reference document's cases (pure arithmetic)."""

from __future__ import annotations

import pytest

from h3serve.rules import geometry
from h3serve.rules.long_video import check_stitch, max_duration_s, on_frame_grid, plan_windows, window_seed

# 1,807 frames with the defaults (277 / 22): 7 windows, each next one starting 22 frames before the previous end.
BOUNDS_1807 = [(0, 277), (255, 532), (510, 787), (765, 1042), (1020, 1297), (1275, 1552), (1530, 1807)]
# Audio latents on the global timeline: round(frame · 5 / 3).
AUDIO_1807 = [(0, 462), (425, 887), (850, 1312), (1275, 1737), (1700, 2162), (2125, 2587), (2550, 3012)]


def test_1807_frames_with_defaults_give_seven_windows():
    windows = plan_windows(1807, 277, 22)
    assert [(w.start, w.end) for w in windows] == BOUNDS_1807
    assert [(w.audio_start, w.audio_end) for w in windows] == AUDIO_1807
    assert [w.index for w in windows] == list(range(7))
    assert [w.latent_frames for w in windows] == [82] * 7
    assert [w.overlap_latent_frames for w in windows] == [0] + [7] * 6  # the latent T of 22 frames
    assert [w.overlap_audio_latents for w in windows] == [0] + [37] * 6  # 462 - 425, ... on the global timeline
    assert [w.temporal_offset for w in windows] == [s * 40 / 24 for s, _ in BOUNDS_1807]
    assert windows[1].temporal_offset == 425.0
    kept_video = sum(w.latent_frames - w.overlap_latent_frames for w in windows)
    kept_audio = sum(w.audio_latents - w.overlap_audio_latents for w in windows)
    assert (kept_video, kept_audio) == (geometry.latent_frames(1807), geometry.audio_latents(1807)) == (532, 3012)


def test_last_window_may_be_shorter_and_stays_on_the_grid():
    windows = plan_windows(974, 277, 22)  # 40 s
    assert [(w.start, w.end) for w in windows] == [(0, 277), (255, 532), (510, 787), (765, 974)]
    assert windows[-1].num_frames == 209 and (209 - 5) % 17 == 0
    assert [w.overlap_audio_latents for w in windows] == [0, 37, 37, 37]
    windows = plan_windows(974, 345, 39)
    assert [(w.start, w.end) for w in windows] == [(0, 345), (306, 651), (612, 957), (918, 974)]
    assert windows[1].overlap_latent_frames == geometry.latent_frames(39) == 12
    assert [w.overlap_audio_latents for w in windows] == [0, 65, 65, 65]  # 575-510, 1085-1020, 1595-1530


def test_a_request_within_one_window_is_one_window():
    (only,) = plan_windows(107, 277, 22)
    assert (only.start, only.end, only.audio_end, only.overlap_latent_frames) == (0, 107, 178, 0)
    (only,) = plan_windows(277, 277, 22)
    assert only.end == 277


@pytest.mark.parametrize("total", [107, 362, 736, 974, 1807, 7213])
@pytest.mark.parametrize("window, overlap", [(277, 22), (107, 5), (345, 328), (124, 107)])
def test_windows_always_stitch_to_the_request(total, window, overlap):
    windows = plan_windows(total, window, overlap)
    check_stitch(windows, total)
    assert windows[0].start == 0 and windows[-1].end == total
    for prev, w in zip(windows, windows[1:], strict=False):
        assert w.start == prev.end - overlap and w.num_frames <= window
        assert w.audio_start == geometry.audio_latents(w.start)


def test_inconsistent_stitch_is_a_runtime_error():
    windows = list(plan_windows(974, 277, 22))
    with pytest.raises(RuntimeError, match="inconsistent cumulative AV lengths"):
        check_stitch(windows[:-1], 974)


def test_grid_and_window_rules():
    assert on_frame_grid(22) and on_frame_grid(5) and on_frame_grid(277)
    for value in (True, 21, 23, 22.0, "22", 0, -12):
        assert not on_frame_grid(value)
    for window, overlap in ((90, 22), (362, 22), (107, 107)):
        with pytest.raises(ValueError, match="107..345"):
            plan_windows(974, window, overlap)


def test_duration_caps_and_seeds():
    assert (max_duration_s(None), max_duration_s("full"), max_duration_s("continuation")) == (15.0, 30.0, 300.0)
    assert [window_seed(42, i) for i in range(3)] == [42, 43, 44]
    assert window_seed(2**63 - 1, 1) == 0


def test_an_extension_starts_with_its_source_as_window_zero():
    windows = plan_windows(141 + 255, 277, 22, first_end=141)  # a 141-frame source and 255 new frames
    assert [(w.start, w.end) for w in windows] == [(0, 141), (119, 396)]
    assert windows[1].overlap_audio_latents == geometry.audio_latents(141) - geometry.audio_latents(119) == 37
    windows = plan_windows(447 + 17, 277, 22, first_end=447)  # a source longer than a window
    assert [(w.start, w.end) for w in windows] == [(0, 447), (425, 464)]
    for bad in (22, 481):
        with pytest.raises(ValueError, match="longer than the overlap"):
            plan_windows(464, 277, 22, first_end=bad)
