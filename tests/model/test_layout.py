"""Layout, RoPE grid and per-row timesteps against the spec's formulas and diffusers' block code."""

from __future__ import annotations

import pytest
import torch
from diffusers.modular_pipelines.minimax_h3.before_denoise import (
    MiniMaxH3PrepareLayoutStep,
    MiniMaxH3SetTimestepsStep,
)

from h3serve.model.layout import AUDIO_TAG, TEXT_TAG, VIDEO_TAG, Role, build_keyframe_layout, patchify, unpatchify


def test_spec_worked_example():
    """Text 41 rows, canvas 32x64 -> latent 2x4, F = 37, A = 207 (spec §3.2)."""
    layout = build_keyframe_layout(torch.full((41,), TEXT_TAG), 37, 2, 4, 207)
    pos = layout.packed.position_ids
    assert layout.packed.seq_len == 41 + 414 + 74 == 529
    audio0, audio1, video0 = pos[41], pos[41 + 207], pos[41 + 414]
    assert audio0.tolist() == pytest.approx([41, 0, -6.62742], abs=1e-5)
    assert audio1.tolist() == pytest.approx([41, 0, 16.0], abs=1e-5)
    assert video0.tolist() == pytest.approx([41, 4.68629, -6.62742], abs=1e-5)
    assert pos[41 + 414 + 1].tolist() == pytest.approx([41, 4.68629, 16.0], abs=1e-5)
    assert pos[41 + 414 + 2, 0].item() == pytest.approx(42.6667, abs=1e-4)  # frame 1 starts 5/3 later


@pytest.mark.parametrize("anchors", [(), ("first",), ("last",), ("first", "last")])
@pytest.mark.parametrize("shape", [(7, 2, 4, 12, 9), (37, 4, 6, 207, 41), (22, 6, 2, 60, 5)])
def test_layout_bit_identical_to_diffusers(anchors, shape):
    frames, lh, lw, audio, text_len = shape
    tags = torch.full((text_len,), TEXT_TAG)
    tags[1:3] = VIDEO_TAG  # a vision block inside the text stream is tagged video
    ours = build_keyframe_layout(tags, frames, lh, lw, audio, anchors)
    pos, ttags, vid, aud, txt, ncond, _ = MiniMaxH3PrepareLayoutStep.build_packed_sequence(
        tags, frames, lh, lw, audio, (1, 2, 2), 2, AUDIO_TAG, VIDEO_TAG, anchors
    )
    p = ours.packed
    assert torch.equal(p.position_ids, pos)
    assert torch.equal(p.token_tags, ttags)
    assert torch.equal(p.video_indices, vid) and torch.equal(p.audio_indices, aud) and torch.equal(p.text_indices, txt)
    assert ours.num_video_condition_rows == ncond
    for tv, ta in [(0.0, 0.0), (0.04, 0.142857), (0.9995, 0.5)]:
        ref_t, ref_i = MiniMaxH3SetTimestepsStep.build_row_timesteps(
            vid, aud, ncond, 0, text_len, tv, ta, max(tv, 0.999), 1.0
        )
        t, i = ours.row_timesteps(tv, ta)
        assert torch.equal(t, ref_t) and torch.equal(i, ref_i)


def test_row_timesteps_roles():
    layout = build_keyframe_layout(torch.full((3,), TEXT_TAG), 7, 2, 2, 4, ("first",))
    t, idx = layout.row_timesteps(0.2, 0.5)
    row_t = t[idx]
    assert torch.all(row_t[layout.roles == Role.TEXT] == 0.2)  # text inherits the video timestep
    assert torch.all(row_t[layout.roles == Role.VIDEO_CONDITION] == torch.tensor(0.999))
    assert torch.all(row_t[layout.roles == Role.AUDIO] == 0.5)
    t0, _ = layout.row_timesteps(0.0, 0.0)
    assert t0.tolist() == pytest.approx([0.0, 0.999])


def test_anchor_times_match_spec_run():
    """Spec §10 FL2VA run: 54 text rows, 124 frames -> first anchor at 54, last at 259, last target frame 254."""
    layout = build_keyframe_layout(torch.full((54,), TEXT_TAG), 37, 2, 4, 207, ("first", "last"))
    pos = layout.packed.position_ids
    assert pos[54, 0].item() == 54.0
    assert pos[54 + 2, 0].item() == pytest.approx(259.0)
    assert pos[-1, 0].item() == pytest.approx(254.0)


def test_patchify_round_trip_and_feature_order():
    x = torch.randn(1, 3, 2, 4, 6)
    rows = patchify(x)
    assert rows.shape == (2 * 2 * 3, 12)
    assert rows[0, 0 * 4 + 1 * 2 + 0] == x[0, 0, 0, 1, 0]  # feature c·4 + dy·2 + dx
    assert rows[1, 2 * 4 + 0 * 2 + 1] == x[0, 2, 0, 0, 3]  # row 1 is the next w patch
    assert torch.equal(unpatchify(rows, 3, 2, 4, 6), x)


def _ref_objects(blocks):
    """diffusers reference objects + latents with the same geometry as our ReferenceBlocks."""
    from diffusers.modular_pipelines.minimax_h3.references import (
        MiniMaxH3AudioReference,
        MiniMaxH3ImageReference,
        MiniMaxH3VideoReference,
    )
    from PIL import Image

    refs, visual, audio = [], [], []
    for b in blocks:
        wave = torch.zeros(2, 800 * b.audio_latents) if b.audio_latents else None
        if b.kind == "image":
            refs.append(MiniMaxH3ImageReference(image=Image.new("RGB", (64, 64))))
        elif b.kind == "video":
            frames = torch.zeros(22, 64, 64, 3, dtype=torch.uint8).numpy()
            refs.append(
                MiniMaxH3VideoReference(
                    frames=frames, fps=24.0, audio=wave, sample_rate=32000 if b.audio_latents else None
                )
            )
        else:
            refs.append(MiniMaxH3AudioReference(audio=wave, sample_rate=32000))
        if b.kind != "audio":
            visual.append(torch.zeros(1, 24, b.latent_frames, b.latent_h, b.latent_w))
        if b.audio_latents:
            audio.append(torch.zeros(2 * b.audio_latents, 32))
    return refs, visual, audio


def test_reference_layout_bit_identical_to_diffusers():
    from diffusers.modular_pipelines.minimax_h3.before_denoise import MiniMaxH3Ref2VAPrepareLayoutStep

    from h3serve.model.layout import ReferenceBlock, build_reference_layout

    blocks = [
        ReferenceBlock("image", 1, 4, 6),
        ReferenceBlock("audio", audio_latents=80),
        ReferenceBlock("video", 22, 2, 4, audio_latents=30),
        ReferenceBlock("video", 7, 4, 2),
        ReferenceBlock("image", 1, 2, 2),
    ]
    tags = torch.full((13,), TEXT_TAG)
    tags[2:5] = VIDEO_TAG
    ours = build_reference_layout(tags, blocks, 37, 2, 4, 207)
    refs, visual, audio = _ref_objects(blocks)
    pos, ttags, vid, aud, txt, nv, na = MiniMaxH3Ref2VAPrepareLayoutStep.build_ref2va_packed_sequence(
        tags, refs, visual, audio, 37, 2, 4, 207, (1, 2, 2), 2, AUDIO_TAG, VIDEO_TAG
    )
    p = ours.packed
    assert torch.equal(p.position_ids, pos) and torch.equal(p.token_tags, ttags)
    assert torch.equal(p.video_indices, vid) and torch.equal(p.audio_indices, aud) and torch.equal(p.text_indices, txt)
    assert (ours.num_video_condition_rows, ours.num_audio_reference_rows) == (nv, na)
    t, idx = ours.row_timesteps(0.0, 0.0)
    assert t.tolist() == pytest.approx([0.0, 0.999, 1.0])  # spec: distinct t at step 0 of ref2va
    assert torch.all(t[idx][ours.roles == Role.AUDIO_REFERENCE] == 1.0)


def test_reference_clock_matches_spec_run():
    """Spec §10: image ref + 2 s audio ref, 45 text rows -> image at t = 45, audio from 46, targets from 126."""
    from h3serve.model.layout import ReferenceBlock, build_reference_layout

    blocks = [ReferenceBlock("image", 1, 4, 4), ReferenceBlock("audio", audio_latents=80)]
    layout = build_reference_layout(torch.full((45,), TEXT_TAG), blocks, 37, 2, 4, 207)
    pos = layout.packed.position_ids
    assert pos[45, 0] == 45.0 and pos[45 + 4, 0] == 46.0
    assert pos[layout.roles == Role.AUDIO][0, 0] == 126.0 and pos[layout.roles == Role.VIDEO][0, 0] == 126.0
    assert layout.num_audio_reference_rows == 160


def test_latent_guide_shares_the_targets_first_positions_and_offsets_shift_temporal_rows_only():
    """Continuation: media clock from `media_origin`, temporal rows shifted by the window's offset (start · 40/24),
    text and still images not; the guide (last) sits on the target's first latent times, pinned like a condition."""
    from h3serve.model.layout import ReferenceBlock, build_reference_layout

    blocks = [ReferenceBlock("image", 1, 4, 4), ReferenceBlock("audio", audio_latents=80)]
    guide = ReferenceBlock("latent_guide", 7, 2, 4, audio_latents=37)
    tags = torch.full((45,), TEXT_TAG)
    plain = build_reference_layout(tags, blocks, 82, 2, 4, 462, media_origin=50.0)
    layout = build_reference_layout(tags, [*blocks, guide], 82, 2, 4, 462, media_origin=50.0, time_offset=425.0)
    pos, roles = layout.packed.position_ids, layout.roles
    assert torch.equal(pos[:45], plain.packed.position_ids[:45])  # text
    assert pos[45, 0] == 50.0  # the image: the clock's start, not shifted
    ref_audio = pos[roles == Role.AUDIO_REFERENCE]
    assert ref_audio[0, 0] == 51.0 + 425.0 and len(ref_audio) == 160 + 74
    target_video, target_audio = pos[roles == Role.VIDEO], pos[roles == Role.AUDIO]
    assert target_video[0, 0] == 131.0 + 425.0 and torch.equal(target_audio, plain.packed.position_ids[
        plain.roles == Role.AUDIO] + torch.tensor([425.0, 0, 0], dtype=torch.float64))
    guide_video = pos[roles == Role.VIDEO_CONDITION][4:]  # after the 4x4 image's 2x2 tokens
    assert torch.equal(guide_video, target_video[: 7 * 2])  # 7 latent frames x 2 tokens, same (t, h, w)
    assert torch.equal(ref_audio[160:], torch.cat([target_audio[:37], target_audio[462 : 462 + 37]]))
    t, index = layout.row_timesteps(0.3, 0.2)
    assert torch.all(t[index[roles == Role.VIDEO_CONDITION]] == torch.tensor(0.999))
    with pytest.raises(ValueError, match="last reference"):
        build_reference_layout(tags, [guide, *blocks], 82, 2, 4, 462)
