"""Timeline guides in the packed layout: token packing and RoPE time origins at the reference note's full-size
example (1344x768, 124 frames, 256 text rows), counted here from the geometry; FL2VA keyframes and Ref2VA
references after the guides; the guides' noise leaves the targets' as they are."""

from __future__ import annotations

import torch

from h3serve.model.layout import (
    AUDIO_TAG,
    TEXT_TAG,
    VIDEO_TAG,
    GuideBlock,
    ReferenceBlock,
    Role,
    build_keyframe_layout,
    build_reference_layout,
    frame_grid,
    patchify,
)
from h3serve.model.pipeline_types import Encoded, LatentTarget
from h3serve.model.sampler import Sampler
from h3serve.model.scheduler import scale_noise

TEXT, LH, LW, FRAMES, AUDIO = 256, 48, 84, 37, 207  # 768x1344, 124 frames
PER_FRAME = (LH // 2) * (LW // 2)  # 1,008 rows per latent frame


def _times(layout, start: int, count: int) -> torch.Tensor:
    return layout.packed.position_ids[start : start + count, 0]


def test_four_image_guides_pack_after_the_text_at_their_frames_time():
    starts = (0, 1, 36, 123)
    layout = build_keyframe_layout(torch.full((TEXT,), TEXT_TAG), FRAMES, LH, LW, AUDIO,
                                   guides=tuple(GuideBlock(s, latent_frames=1) for s in starts))
    assert layout.packed.seq_len == TEXT + 4 * PER_FRAME + 2 * AUDIO + FRAMES * PER_FRAME == 41_998
    assert layout.num_video_condition_rows == 4 * PER_FRAME == 4032 and layout.num_audio_reference_rows == 0
    roles = layout.roles
    assert (roles[TEXT : TEXT + 4032] == Role.VIDEO_CONDITION).all()
    assert (roles[TEXT + 4032 : TEXT + 4032 + 2 * AUDIO] == Role.AUDIO).all()
    grid, _ = frame_grid(LH, LW)
    for k, start in enumerate(starts):
        rows = slice(TEXT + k * PER_FRAME, TEXT + (k + 1) * PER_FRAME)
        origin = 256.0 + 5.0 * start / 3.0  # T0 + (5/3)·start, the fraction kept: 256, 257.667, 316, 461
        assert torch.equal(layout.packed.position_ids[rows, 0], torch.full((PER_FRAME,), origin, dtype=torch.float64))
        assert torch.equal(layout.packed.position_ids[rows, 1:], grid)  # the target's own spatial grid
        assert (layout.packed.token_tags[rows] == VIDEO_TAG).all()
    assert layout.packed.position_ids[TEXT + PER_FRAME, 0] == 256 + 5 / 3  # never rounded to a latent frame
    # The targets keep T0 = the text length: the guides do not move them.
    plain = build_keyframe_layout(torch.full((TEXT,), TEXT_TAG), FRAMES, LH, LW, AUDIO)
    assert torch.equal(layout.packed.position_ids[TEXT + 4032 :], plain.packed.position_ids[TEXT:])


def test_a_guide_sits_at_the_time_of_the_target_frame_it_shows():
    """Target latent frame 5c + r starts at pixel frame 17c + (4r - 3 if r else 0): latent frame 9 at frame 30. A
    guide at that frame has exactly its time."""
    layout = build_keyframe_layout(torch.full((TEXT,), TEXT_TAG), FRAMES, LH, LW, AUDIO,
                                   guides=(GuideBlock(30, latent_frames=1),))
    target_frame_9 = TEXT + PER_FRAME + 2 * AUDIO + 9 * PER_FRAME
    assert layout.packed.position_ids[TEXT, 0] == layout.packed.position_ids[target_frame_9, 0] == 256 + 50


def test_a_clip_with_its_sound_packs_its_frames_at_the_video_cadence_then_the_sound():
    """A 22-frame clip at -22 (start 102) with a sound: 7 latent frames, 7,056 rows, times T0 + 170 + (0, 5/3, 25/3,
    15, 65/3, 85/3, 30); then 2 x L sound rows from T0 + 170, one unit a latent, on the width axis' extremes."""
    audio = (3 * AUDIO - 5 * 102) // 3  # L = 37
    layout = build_keyframe_layout(torch.full((TEXT,), TEXT_TAG), FRAMES, LH, LW, AUDIO,
                                   guides=(GuideBlock(102, latent_frames=7, audio_latents=audio),))
    origin = 256 + 170.0
    visual = 7 * PER_FRAME
    assert visual == 7056 and layout.num_video_condition_rows == visual
    frame_starts = _times(layout, TEXT, visual)[::PER_FRAME]
    expected = origin + torch.tensor([0, 5, 25, 45, 65, 85, 90], dtype=torch.float64) / 3
    assert torch.allclose(frame_starts, expected, rtol=0, atol=1e-12)
    sound = slice(TEXT + visual, TEXT + visual + 2 * audio)
    assert (layout.roles[sound] == Role.AUDIO_REFERENCE).all() and (layout.packed.token_tags[sound] == AUDIO_TAG).all()
    times = layout.packed.position_ids[sound, 0]
    assert torch.equal(times[:audio], origin + torch.arange(audio, dtype=torch.float64))
    assert torch.equal(times[audio:], times[:audio])
    _, width_axis = frame_grid(LH, LW)
    assert (layout.packed.position_ids[sound, 2][:audio] == width_axis[0]).all()
    assert (layout.packed.position_ids[sound, 2][audio:] == width_axis[-1]).all()
    # The target audio's latent j sits at T0 + j: the sound's first latent is the target's latent 170.
    target_audio = TEXT + visual + 2 * audio
    assert layout.packed.position_ids[target_audio + 170, 0] == times[0]
    assert layout.num_audio_reference_rows == 2 * audio
    # row times: the picture near clean, the sound clean, the targets at the step's times
    row_t = layout.row_times(0.25, 0.5)
    assert (row_t[TEXT : TEXT + visual] == 0.999).all() and (row_t[sound] == 1.0).all()
    assert (row_t[target_audio : target_audio + 2 * AUDIO] == 0.5).all() and (row_t[-1] == 0.25)


def test_keyframes_come_after_the_guides_on_their_own_anchor_times():
    layout = build_keyframe_layout(torch.full((TEXT,), TEXT_TAG), FRAMES, LH, LW, AUDIO, anchors=("first", "last"),
                                   guides=(GuideBlock(60, latent_frames=1),))
    times = layout.packed.position_ids[:, 0]
    assert times[TEXT] == 256 + 100  # the guide
    assert times[TEXT + PER_FRAME] == 256  # the first keyframe at T0
    assert abs(times[TEXT + 2 * PER_FRAME] - (256 + 5 * 123 / 3)) < 1e-12  # the last at the final frame's time
    assert layout.num_video_condition_rows == 3 * PER_FRAME


def test_ref2va_guides_sit_on_the_clock_after_the_references_and_do_not_move_it():
    """T0 = text + the references' spans (an image 1 unit, a 2 s sound 80); the guides pack before the references."""
    refs = [ReferenceBlock("image", 1, 64, 64), ReferenceBlock("audio", audio_latents=80)]
    guides = (GuideBlock(36, latent_frames=1, audio_latents=10),)
    text = torch.full((TEXT,), TEXT_TAG)
    layout = build_reference_layout(text, refs, FRAMES, LH, LW, AUDIO, guides=guides)
    plain = build_reference_layout(text, refs, FRAMES, LH, LW, AUDIO)
    t0 = 256 + 1 + 80
    times = layout.packed.position_ids[:, 0]
    assert times[TEXT] == t0 + 60 and times[TEXT + PER_FRAME] == t0 + 60  # picture, then its sound
    guide_rows = PER_FRAME + 20
    assert times[TEXT + guide_rows] == 256  # the reference image, then the sound reference
    assert torch.equal(layout.packed.position_ids[TEXT + guide_rows :], plain.packed.position_ids[TEXT:])
    assert layout.num_audio_reference_rows == 20 + 2 * 80


def test_guide_noise_is_drawn_apart_and_leaves_the_targets_noise_alone(tiny_pipeline):
    """Guides' condition noise comes from a fresh generator seeded with the request's seed; a keyframe's and the
    targets' noise are then exactly those of the request without the guide."""
    pipeline, _ = tiny_pipeline
    sampler = Sampler(pipeline.components, torch.device("cpu"))
    target = LatentTarget(2, 4, 8, 6)
    keyframe = torch.randn(1, 24, 1, 4, 8, generator=torch.Generator().manual_seed(1))
    guide = torch.randn(1, 24, 2, 4, 8, generator=torch.Generator().manual_seed(2))

    def rows(visual, guides):
        enc = Encoded([], torch.zeros(1, 1, 1), None, visual, [], guide_visuals=guides)
        return sampler.initial_rows(enc, target, seed=7)

    plain = rows([keyframe], 0)
    guided = rows([guide, keyframe], 1)
    guide_rows = 2 * 2 * 4
    assert torch.equal(guided[0][guide_rows:], plain[0])  # the keyframe's and the targets' rows
    assert torch.equal(guided[2], plain[2]) and torch.equal(guided[3], plain[3])
    noise = torch.randn(guide.shape, generator=torch.Generator().manual_seed(7))
    expected = scale_noise(guide, 0.999, noise)
    assert torch.equal(guided[0][:guide_rows], patchify(expected))
