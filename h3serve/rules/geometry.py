"""Pure shape planning: frame snapping, canvas sizes, latent and audio counts.

Every function is side-effect free and matches the reference pipeline's arithmetic exactly.
"""

from __future__ import annotations

import math

from h3serve.rules import limits


def snap_frames_up(num_frames: int) -> int:
    """The smallest frame count of the form 17n + 5 (n >= 1) that is >= `num_frames`."""
    if num_frames < 1:
        raise ValueError(f"num_frames must be positive, got {num_frames}")
    block, rest = limits.VAE_FRAMES_PER_CHUNK, limits.VAE_LATENTS_PER_CHUNK
    n = max(1, math.ceil((num_frames - rest) / block))
    return block * n + rest


def frames_for_duration(seconds: float) -> int:
    """Frames covering `seconds` at 24 fps, snapped up to 17n + 5 (4 s -> 107, 5 s -> 124, 15 s -> 362)."""
    # round() first so that 5.0 * 24 computed in floating point never becomes 120.00000000000001 -> 121.
    return snap_frames_up(math.ceil(round(seconds * limits.FPS, 6)))


def latent_frames(num_frames: int) -> int:
    """Latent frames the video VAE produces for a 17n + 5 frame count: 5n + 2."""
    block, rest = limits.VAE_FRAMES_PER_CHUNK, limits.VAE_LATENTS_PER_CHUNK
    if num_frames % block != rest:
        raise ValueError(f"num_frames must be of the form {block}n + {rest}, got {num_frames}")
    return (num_frames - rest) // block * rest + 2


def latent_edge(pixels: int) -> int:
    """A canvas edge in video latent cells (the VAE's spatial compression, 16); patches are 2 cells."""
    return pixels // limits.VAE_SPATIAL_COMPRESSION


def audio_latents(num_frames: int) -> int:
    """Audio latents per channel for a video of `num_frames` frames (40 per second, Python rounding)."""
    return int(round(num_frames / limits.FPS * limits.AUDIO_LATENTS_PER_SECOND))


def resolve_canvas_size(aspect_w: float, aspect_h: float, short_edge: int, max_pixels: float) -> tuple[int, int]:
    """(height, width) of the canvas for an aspect ratio: short edge first, area capped, rounded to 32."""
    if aspect_w <= 0 or aspect_h <= 0:
        raise ValueError(f"aspect ratio must be positive, got {aspect_w}:{aspect_h}")
    ratio = aspect_w / aspect_h
    if ratio >= 1.0:
        width, height = short_edge * ratio, float(short_edge)
    else:
        width, height = float(short_edge), short_edge / ratio
    area = width * height
    if area > max_pixels:
        scale = (max_pixels / area) ** 0.5
        width, height = width * scale, height * scale
    m = limits.SPATIAL_MULTIPLE
    return max(m, round(height / m) * m), max(m, round(width / m) * m)
