"""Packed-sequence layout: which row is what, where it sits in RoPE space, and its per-step timestep.

Pure functions over shapes (docs/model.md §2, §3, §8). The packed order is
  T2VA   [text | target audio ch0, ch1 | target video]
  FL2VA  [text | keyframe rows (first, then last) | target audio | target video]
  Ref2VA [text | reference blocks in request order | target audio | target video]
Every coordinate is float64, exactly as the reference computes it, and cast to fp32 only inside RoPE.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

import numpy as np
import torch

from h3serve.model.transformer import PackedLayout

VIDEO_TAG, TEXT_TAG, AUDIO_TAG = 0, 1, 2
ROPE_SPATIAL_SCALE = 32.0
ROPE_FRAME_RESCALE = 5.0 / 3.0
ROPE_FRAMES_PER_LATENT = (1, 4, 4, 4, 4)  # pixel frames covered by latent frame i (mod 5)
AUDIO_CHANNELS = 2


class Role(IntEnum):
    """What a row is, which decides its timestep and whether the sampler writes it."""

    TEXT = 0
    VIDEO_CONDITION = 1  # keyframe / reference image or video rows: pinned near clean
    AUDIO_REFERENCE = 2  # clean reference audio rows: t = 1
    AUDIO = 3  # generated audio
    VIDEO = 4  # generated video


@dataclass(frozen=True)
class Layout:
    """A `PackedLayout` for the transformer plus the row roles the sampler needs."""

    packed: PackedLayout
    roles: torch.Tensor  # [S] long (Role)
    num_video_condition_rows: int
    num_audio_reference_rows: int

    def row_timesteps(
        self, t_video: float, t_audio: float, condition_t: float = 0.999
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-row timesteps reduced to (distinct sorted timesteps [T] fp32, row -> index [S])."""
        return torch.unique(self.row_times(t_video, t_audio, condition_t), sorted=True, return_inverse=True)

    def row_times(self, t_video: float, t_audio: float, condition_t: float = 0.999) -> torch.Tensor:
        """The timestep of every row [S] fp32: targets at the step's t, conditions pinned near or at clean."""
        row_t = torch.full((self.packed.seq_len,), t_video, dtype=torch.float32)
        row_t[self.roles == Role.VIDEO_CONDITION] = max(t_video, condition_t)
        row_t[self.roles == Role.AUDIO] = t_audio
        row_t[self.roles == Role.AUDIO_REFERENCE] = 1.0
        return row_t


def spatial_axis(n: int, sqrt_area: float, patch: int = 2) -> np.ndarray:
    """One aspect-normalised RoPE axis of `n // patch` coordinates, centred, spanning 32 units on a square."""
    ratio = n / sqrt_area
    left = (1.0 - ratio) / 2.0
    return np.linspace(left, left + ratio, n // patch, endpoint=False) * ROPE_SPATIAL_SCALE


def frame_grid(latent_h: int, latent_w: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(h, w) coordinates of one latent frame's rows [rows, 2] (row-major), and its width axis."""
    sqrt_area = np.sqrt(latent_h * latent_w)
    hs = torch.from_numpy(spatial_axis(latent_h, sqrt_area))
    ws = torch.from_numpy(spatial_axis(latent_w, sqrt_area))
    gh, gw = torch.meshgrid(hs, ws, indexing="ij")
    return torch.stack([gh.reshape(-1), gw.reshape(-1)], dim=-1), ws


def frame_times(num_latent_frames: int, origin: float) -> torch.Tensor:
    """RoPE time of each latent frame: steps of 5/3·(1, 4, 4, 4, 4), cumulative, from `origin`."""
    spans = torch.tensor(
        [ROPE_FRAME_RESCALE * ROPE_FRAMES_PER_LATENT[i % 5] for i in range(num_latent_frames)], dtype=torch.float64
    )
    return origin + torch.cat([torch.zeros(1, dtype=torch.float64), spans[:-1].cumsum(0)])


def last_anchor_time(num_latent_frames: int, origin: float) -> float:
    """RoPE time of a "last" keyframe: the final pixel frame's time (numpy pairwise sum, as the reference)."""
    spans = np.ones(num_latent_frames, dtype=np.float64) * ROPE_FRAME_RESCALE
    for offset, frames in enumerate(ROPE_FRAMES_PER_LATENT):
        spans[offset::5] *= frames
    return origin + float(spans.sum()) - ROPE_FRAME_RESCALE


def audio_positions(origin: float, num_latents: int, width_axis: torch.Tensor) -> torch.Tensor:
    """A channel-major stereo block's positions [2·n, 3]: t from `origin`, h = 0, w pinned to the width axis' first
    (ch0) / last (ch1) value."""
    time = origin + torch.arange(num_latents, dtype=torch.float64)
    rows = torch.zeros(AUDIO_CHANNELS * num_latents, 3, dtype=torch.float64)
    rows[:, 0] = time.repeat(AUDIO_CHANNELS)
    rows[:num_latents, 2] = float(width_axis[0])
    rows[num_latents:, 2] = float(width_axis[-1])
    return rows


class _Rows:
    """Accumulates row blocks in packed order."""

    def __init__(self) -> None:
        self.positions: list[torch.Tensor] = []
        self.tags: list[torch.Tensor] = []
        self.roles: list[torch.Tensor] = []
        self.target_grid: tuple[int, int, int] | None = None  # set by the target video's frames (the last rows)

    def add(self, positions: torch.Tensor, tag: int | torch.Tensor, role: Role) -> None:
        n = positions.shape[0]
        self.positions.append(positions.to(torch.float64))
        self.tags.append(tag.long() if isinstance(tag, torch.Tensor) else torch.full((n,), tag, dtype=torch.long))
        self.roles.append(torch.full((n,), int(role), dtype=torch.long))

    def add_video_frames(
        self, times: torch.Tensor, grid: torch.Tensor, role: Role, shape: tuple[int, int] | None = None
    ) -> None:
        """One video block's frames; the target's (`role` VIDEO) also records its grid, (rows, columns) `shape`."""
        if role == Role.VIDEO:
            if shape is None or shape[0] * shape[1] != grid.shape[0]:
                raise ValueError("the target video's frames need their (rows, columns)")
            self.target_grid = (times.shape[0], *shape)
        rows = torch.empty(times.shape[0], grid.shape[0], 3, dtype=torch.float64)
        rows[:, :, 0] = times[:, None]
        rows[:, :, 1:] = grid[None]
        self.add(rows.reshape(-1, 3), VIDEO_TAG, role)

    def add_audio(self, origin: float, num_latents: int, width_axis: torch.Tensor, role: Role) -> None:
        self.add(audio_positions(origin, num_latents, width_axis), AUDIO_TAG, role)

    def build(self) -> Layout:
        positions = torch.cat(self.positions)
        tags = torch.cat(self.tags)
        roles = torch.cat(self.roles)
        is_video = (roles == Role.VIDEO_CONDITION) | (roles == Role.VIDEO)
        is_audio = (roles == Role.AUDIO_REFERENCE) | (roles == Role.AUDIO)
        packed = PackedLayout(
            token_tags=tags,
            position_ids=positions,
            video_indices=is_video.nonzero().flatten(),
            audio_indices=is_audio.nonzero().flatten(),
            text_indices=(roles == Role.TEXT).nonzero().flatten(),
            target_grid=self.target_grid,
        )
        if self.target_grid is not None and roles[-1] != Role.VIDEO:
            raise ValueError("the target video's rows must end the packed sequence")
        return Layout(
            packed=packed,
            roles=roles,
            num_video_condition_rows=int((roles == Role.VIDEO_CONDITION).sum()),
            num_audio_reference_rows=int((roles == Role.AUDIO_REFERENCE).sum()),
        )


def text_positions(num_text: int) -> torch.Tensor:
    positions = torch.zeros(num_text, 3, dtype=torch.float64)
    positions[:, 0] = torch.arange(num_text, dtype=torch.float64)
    return positions


def build_keyframe_layout(
    text_tags: torch.Tensor,  # [L]: 1 for text, 0 for vision-block tokens of the presentation
    latent_frames: int,
    latent_h: int,
    latent_w: int,
    audio_latents: int,
    anchors: tuple[str, ...] = (),  # () for T2VA; ("first",), ("last",) or ("first", "last") for FL2VA
) -> Layout:
    """The T2VA / FL2VA layout: [text | keyframe rows | target audio | target video]."""
    num_text = text_tags.shape[0]
    origin = float(num_text)  # the media clock starts after the text rows
    grid, width_axis = frame_grid(latent_h, latent_w)

    rows = _Rows()
    rows.add(text_positions(num_text), text_tags, Role.TEXT)
    for anchor in anchors:
        if anchor == "first":
            t = origin
        elif anchor == "last":
            t = last_anchor_time(latent_frames, origin)
        else:
            raise ValueError(f"keyframe anchor must be 'first' or 'last', got {anchor!r}")
        rows.add_video_frames(torch.tensor([t], dtype=torch.float64), grid, Role.VIDEO_CONDITION)
    rows.add_audio(origin, audio_latents, width_axis, Role.AUDIO)
    rows.add_video_frames(frame_times(latent_frames, origin), grid, Role.VIDEO, (latent_h // 2, latent_w // 2))
    return rows.build()


@dataclass(frozen=True)
class ReferenceBlock:
    """Geometry of one Ref2VA reference as encoded: visual latent (frames, h, w) and audio latents per channel.

    Kind "latent_guide" is a continuation window's carry-over (the previous window's last overlap latents): it
    must be last, is on the target canvas, and sits on the RoPE positions of the target's first latents.
    """

    kind: str  # "image" | "video" | "audio" | "latent_guide"
    latent_frames: int = 0
    latent_h: int = 0
    latent_w: int = 0
    audio_latents: int = 0  # a video's soundtrack, or an audio reference


def build_reference_layout(
    text_tags: torch.Tensor,
    references: list[ReferenceBlock],
    latent_frames: int,
    latent_h: int,
    latent_w: int,
    audio_latents: int,
    media_origin: float | None = None,
    time_offset: float = 0.0,
) -> Layout:
    """The Ref2VA layout. A clock starts after the text; each reference occupies the next stretch of it:
    an image one unit, an audio clip its latent count, a video the longer of its soundtrack and its frames.
    The targets start at the final clock.

    Continuation windows: `media_origin` starts the clock there instead (after the longest window prompt, so
    every window's media share one clock), and `time_offset` (the window's start · 40/24) shifts the temporal
    rows (audio and video references, the guide, the targets), not the text or still images.
    """
    clock = float(text_tags.shape[0]) if media_origin is None else float(media_origin)
    target_grid, target_width_axis = frame_grid(latent_h, latent_w)
    rows = _Rows()
    rows.add(text_positions(text_tags.shape[0]), text_tags, Role.TEXT)
    for index, ref in enumerate(references):
        if ref.kind == "image":
            grid, _ = frame_grid(ref.latent_h, ref.latent_w)
            rows.add_video_frames(torch.tensor([clock], dtype=torch.float64), grid, Role.VIDEO_CONDITION)
            clock += 1.0
        elif ref.kind == "audio":
            rows.add_audio(clock + time_offset, ref.audio_latents, target_width_axis, Role.AUDIO_REFERENCE)
            clock += float(ref.audio_latents)
        elif ref.kind == "video":
            grid, width_axis = frame_grid(ref.latent_h, ref.latent_w)
            if ref.audio_latents:  # the soundtrack sits right before its frames, on the video's own width axis
                rows.add_audio(clock + time_offset, ref.audio_latents, width_axis, Role.AUDIO_REFERENCE)
            rows.add_video_frames(frame_times(ref.latent_frames, clock + time_offset), grid, Role.VIDEO_CONDITION)
            # Sequential Python float sum, as the reference computes this span (not numpy's pairwise sum).
            span = sum(ROPE_FRAME_RESCALE * ROPE_FRAMES_PER_LATENT[i % 5] for i in range(ref.latent_frames))
            clock += max(float(ref.audio_latents), span)
        elif ref.kind == "latent_guide":
            if index != len(references) - 1 or (ref.latent_h, ref.latent_w) != (latent_h, latent_w):
                raise ValueError("a latent guide must be the last reference and on the target canvas")
            if ref.latent_frames > latent_frames or ref.audio_latents > audio_latents:
                raise ValueError("a latent guide cannot be longer than its window")
            origin = clock + time_offset
            rows.add_audio(origin, ref.audio_latents, target_width_axis, Role.AUDIO_REFERENCE)
            times = frame_times(latent_frames, origin)[: ref.latent_frames]  # the target's first latent times
            rows.add_video_frames(times, target_grid, Role.VIDEO_CONDITION)
        else:
            raise ValueError(f"reference kind must be 'image', 'video', 'audio' or 'latent_guide', got {ref.kind!r}")
    rows.add_audio(clock + time_offset, audio_latents, target_width_axis, Role.AUDIO)
    rows.add_video_frames(frame_times(latent_frames, clock + time_offset), target_grid, Role.VIDEO,
                          (latent_h // 2, latent_w // 2))
    return rows.build()


def patchify(latents: torch.Tensor) -> torch.Tensor:
    """[B, C, F, H, W] -> [B·F·(H/2)·(W/2), C·4]: rows frame -> h -> w, features c·4 + dy·2 + dx."""
    b, c, f, h, w = latents.shape
    x = latents.reshape(b, c, f, h // 2, 2, w // 2, 2).permute(0, 2, 3, 5, 1, 4, 6)
    return x.reshape(-1, c * 4).contiguous()


def unpatchify(rows: torch.Tensor, channels: int, frames: int, h: int, w: int) -> torch.Tensor:
    """Inverse of `patchify` for batch 1: [F·(H/2)·(W/2), C·4] -> [1, C, F, H, W]."""
    x = rows.reshape(1, frames, h // 2, w // 2, channels, 2, 2).permute(0, 4, 1, 2, 5, 3, 6)
    return x.reshape(1, channels, frames, h, w).contiguous()
