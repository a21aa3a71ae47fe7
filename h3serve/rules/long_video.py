"""Long video planning: duration caps per mode and the continuation windows (pure arithmetic, no torch).

Modes (`long_video_mode`): without `long_video` a request is one pass of at most 15 s; `full` is one pass of at
most 30 s (a longer packed sequence, nothing else changes); `continuation` (at most 300 s, the Ref2VA path)
generates overlapping windows on the 17n + 5 frame grid and stitches their latents with a hard cut.

Windows: the first is `[0, min(total, W))`; each next starts `O` frames before the previous end and ends at
`min(total, start + W)`, so the last may be shorter (it is still on the grid: W - O is a multiple of 17).
Audio bounds come from the *global* timeline (`audio_latents(frame)`), so the stitched soundtrack never drifts.
"""

from __future__ import annotations

from dataclasses import dataclass

from h3serve.rules import geometry, limits
from h3serve.rules.names import LONG_VIDEO_MODES

MODES = LONG_VIDEO_MODES
ROPE_UNITS_PER_FRAME = limits.AUDIO_LATENTS_PER_SECOND / limits.FPS  # 40 Hz RoPE clock: 5/3 per output frame


def max_duration_s(mode: str | None) -> float:
    """The duration cap: 15 s without long video (mode None), 30 s for `full`, 300 s for `continuation`."""
    return {
        None: limits.MAX_DURATION_S,
        "full": limits.MAX_FULL_DURATION_S,
        "continuation": limits.MAX_CONTINUATION_DURATION_S,
    }[mode]


def on_frame_grid(value: object) -> bool:
    """A non-bool integer >= 5 of the form 17n + 5."""
    return (
        isinstance(value, int)
        and not isinstance(value, bool)
        and value >= limits.MIN_OVERLAP_FRAMES
        and value % limits.VAE_FRAMES_PER_CHUNK == limits.VAE_LATENTS_PER_CHUNK
    )


def window_fits(window_frames: int, overlap_frames: int) -> bool:
    """The window is 107..345 frames and longer than its overlap."""
    return limits.MIN_WINDOW_FRAMES <= window_frames <= limits.MAX_WINDOW_FRAMES and window_frames > overlap_frames


@dataclass(frozen=True)
class Window:
    """One continuation window: output frames `[start, end)` and audio latents `[audio_start, audio_end)` on the
    global timeline, and how many of its own leading latents the stitch drops (its overlap with the previous one;
    0 for the first window)."""

    index: int
    start: int
    end: int
    audio_start: int
    audio_end: int
    overlap_latent_frames: int  # video latents dropped at the join = the carried guide's latent frames
    overlap_audio_latents: int  # audio latents per channel dropped at the join = the guide's audio latents

    @property
    def num_frames(self) -> int:
        return self.end - self.start

    @property
    def latent_frames(self) -> int:
        return geometry.latent_frames(self.num_frames)

    @property
    def audio_latents(self) -> int:
        return self.audio_end - self.audio_start

    @property
    def temporal_offset(self) -> float:
        """RoPE time shift of this window's target, guide and temporal references: start · 40 / 24."""
        return self.start * ROPE_UNITS_PER_FRAME


def plan_windows(
    total_frames: int, window_frames: int, overlap_frames: int, first_end: int | None = None
) -> tuple[Window, ...]:
    """The continuation windows covering `total_frames` (17n + 5). Raises `ValueError` on off-grid input.

    `first_end` (an extension) makes window 0 the given source, `[0, first_end)` of any grid length above the
    overlap; the generated windows follow it by the same rule."""
    checked = [("total", total_frames), ("window", window_frames), ("overlap", overlap_frames)]
    for name, value in [*checked, *([("source", first_end)] if first_end is not None else [])]:
        if not on_frame_grid(value):
            raise ValueError(f"{name} frames must be on the 17n+5 grid, got {value}")
    if not window_fits(window_frames, overlap_frames):
        raise ValueError(f"window must be 107..345 frames and exceed its overlap, got {window_frames}/{overlap_frames}")
    if first_end is not None and not overlap_frames < first_end <= total_frames:
        raise ValueError(f"a source of {first_end} frames must be longer than the overlap and within the total")
    overlap_v = geometry.latent_frames(overlap_frames)
    windows: list[Window] = []
    start, end = 0, min(total_frames, window_frames) if first_end is None else first_end
    while True:
        first = not windows
        prev_end = windows[-1].end if windows else 0
        windows.append(
            Window(
                index=len(windows),
                start=start,
                end=end,
                audio_start=geometry.audio_latents(start),
                audio_end=geometry.audio_latents(end),
                overlap_latent_frames=0 if first else overlap_v,
                overlap_audio_latents=0 if first else geometry.audio_latents(prev_end) - geometry.audio_latents(start),
            )
        )
        if end >= total_frames:
            break
        start = end - overlap_frames
        end = min(total_frames, start + window_frames)
    check_stitch(windows, total_frames)
    return tuple(windows)


def check_stitch(windows: list[Window] | tuple[Window, ...], total_frames: int) -> None:
    """The kept latents of every window add up to the whole request's; `RuntimeError` otherwise."""
    video = sum(w.latent_frames - w.overlap_latent_frames for w in windows)
    audio = sum(w.audio_latents - w.overlap_audio_latents for w in windows)
    if (video, audio) != (geometry.latent_frames(total_frames), geometry.audio_latents(total_frames)):
        raise RuntimeError("continuation produced inconsistent cumulative AV lengths")


def window_seed(seed: int, index: int) -> int:
    """Window i's noise seed: seed + i (wrapping inside the seed range), so no two windows start from the same
    noise (vLLM-Omni reuses one seed for every window)."""
    return (seed + index) % (limits.SEED_MAX + 1)
