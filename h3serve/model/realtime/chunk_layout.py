"""The packed documents of a real-time session, on its global RoPE timeline.

A chunk is one T2VA document [text | audio ch0, ch1 | video] of the chunk's latents, re-timed: its video latents at
their global times (the release's 5/3·(1, 4, 4, 4, 4) spacing, continued across requests), its audio latents at
their global 40 Hz index, both from the media origin (the session's first prompt length), and the current prompt
right-aligned to the start of the chunk's request. The audio teacher's document is audio-only,
[text | previous request's clean tail (40 latents, t = 1) | the request's audio], on its own short timeline.
"""

from __future__ import annotations

import torch

from h3serve.model.layout import (
    AUDIO_TAG,
    Layout,
    Role,
    audio_positions,
    build_keyframe_layout,
    frame_grid,
    text_positions,
)
from h3serve.model.transformer import PackedLayout
from h3serve.rules import limits
from h3serve.rules.realtime_geometry import ROLLOVER_LATENTS, Chunk, video_time


def chunk_layout(tags: torch.Tensor, origin: int, chunk: Chunk, latent_h: int, latent_w: int) -> Layout:
    """Chunk `chunk`'s document for a prompt of `tags`, its media timed from `origin`."""
    layout = build_keyframe_layout(tags, chunk.video_latents, latent_h, latent_w, chunk.audio_latents)
    packed = layout.packed
    time = packed.position_ids[:, 0]  # the layout's own fresh tensor: re-timed in place
    length = tags.shape[0]
    start = float(origin + video_time(chunk.request_video_start) - length)
    time[packed.text_indices] = start + torch.arange(length, dtype=torch.float64)
    audio = origin + torch.arange(chunk.audio_start, chunk.audio_stop, dtype=torch.float64)
    time[packed.audio_indices] = audio.repeat(limits.AUDIO_CHANNELS)
    video = torch.tensor([float(origin + video_time(i)) for i in range(chunk.video_start, chunk.video_stop)],
                         dtype=torch.float64)
    time[packed.video_indices] = video.repeat_interleave(packed.video_indices.numel() // chunk.video_latents)
    return layout


def teacher_layout(
    tags: torch.Tensor, latent_h: int, latent_w: int, audio_latents: int, previous_latents: int | None
) -> Layout:
    """The audio teacher's document for a request of `audio_latents` latents per channel; with `previous_latents`
    (the previous request's count) the previous request's last 40 clean latents come first, as a reference."""
    length = tags.shape[0]
    _, width = frame_grid(latent_h, latent_w)
    reference = 0 if previous_latents is None else ROLLOVER_LATENTS
    target_time = float(length + (previous_latents or 0))
    blocks = [text_positions(length), audio_positions(target_time, audio_latents, width)]
    if reference:
        blocks.insert(1, audio_positions(target_time - reference, reference, width))
    positions = torch.cat(blocks)
    audio_rows = positions.shape[0] - length
    roles = torch.cat([
        torch.full((length,), int(Role.TEXT)),
        torch.full((limits.AUDIO_CHANNELS * reference,), int(Role.AUDIO_REFERENCE)),
        torch.full((limits.AUDIO_CHANNELS * audio_latents,), int(Role.AUDIO)),
    ])
    packed = PackedLayout(
        token_tags=torch.cat([tags.long(), torch.full((audio_rows,), AUDIO_TAG)]),
        position_ids=positions,
        video_indices=torch.zeros(0, dtype=torch.long),
        audio_indices=torch.arange(length, length + audio_rows),
        text_indices=torch.arange(length),
    )
    return Layout(packed, roles, 0, limits.AUDIO_CHANNELS * reference)
