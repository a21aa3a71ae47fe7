"""Latent-mask editing masks: JSON in, one canonical grid out (pure numpy, no torch).

A mask is a JSON number or a nested array of numbers in [0, 1] on the *latent* grid, per latent frame:
1 = generate, 0 = keep the source, between = blend. Leading size-1 dimensions are squeezed.
- video: a scalar, a flat (T·H/2·W/2,), a token grid (T, H/2, W/2) (upsampled 2x2) or a full grid (T, H, W),
  where T is the latent frame count and H, W the latent canvas (pixels / 16);
- audio: a scalar, (A,) (both channels), (2, A), or a flat (2·A,) channel-major, A = audio latents per channel.
An all-1 mask edits nothing and is dropped (None), so it is exactly plain generation.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import numpy as np

from h3serve.errors import ClientError
from h3serve.rules import limits


class MaskError(ClientError, ValueError):
    """A mask breaks a rule; the message says which, without the field (the caller names it)."""

    code = "invalid_request"


@dataclass(frozen=True)
class LatentMask:
    """A canonical mask: float32 values (C order) and their shape; hashable, picklable, comparable."""

    shape: tuple[int, ...]
    data: bytes

    @classmethod
    def of(cls, array: np.ndarray) -> LatentMask:
        array = np.ascontiguousarray(array, dtype=np.float32)
        return cls(tuple(array.shape), array.tobytes())

    def array(self) -> np.ndarray:
        return np.frombuffer(self.data, dtype=np.float32).reshape(self.shape).copy()


def parse_mask_json(raw: bytes | str) -> object:
    """A mask file's or form field's JSON text -> its value. Size, UTF-8, non-empty, not null, nesting < 64."""
    size = len(raw.encode("utf-8") if isinstance(raw, str) else raw)
    if size > limits.MAX_MASK_BYTES:
        raise MaskError(f"JSON exceeds the {limits.MAX_MASK_BYTES // 2**20} MiB limit")
    try:
        text = raw if isinstance(raw, str) else raw.decode("utf-8")
    except UnicodeDecodeError:
        raise MaskError("must be UTF-8 JSON") from None
    if not text.strip():
        raise MaskError("is empty")
    depth = max_depth = 0
    for char in text:  # before json.loads: deep nesting must not reach the parser's recursion
        if char == "[" or char == "{":
            depth += 1
            max_depth = max(max_depth, depth)
        elif char == "]" or char == "}":
            depth -= 1
    if max_depth >= limits.MAX_MASK_NESTING:
        raise MaskError("contains invalid JSON or is nested too deeply")
    try:
        value = json.loads(text)
    except ValueError:
        raise MaskError("contains invalid JSON or is nested too deeply") from None
    if value is None:
        raise MaskError("must not be null")
    return value


def _values(value: object) -> np.ndarray:
    """Numbers only (no booleans), non-empty, regular, finite, in [0, 1]."""

    def walk(item: object, depth: int) -> None:
        if depth >= limits.MAX_MASK_NESTING:
            raise MaskError("is nested too deeply")
        if isinstance(item, bool):
            raise MaskError("must not contain booleans")
        if isinstance(item, list | tuple):
            if not item:
                raise MaskError("must be non-empty and finite")
            for child in item:
                walk(child, depth + 1)
        elif not isinstance(item, int | float):
            raise MaskError(f"must hold numbers only, got {type(item).__name__}")

    walk(value, 0)
    try:
        array = np.asarray(value, dtype=np.float64)
    except (ValueError, OverflowError):
        raise MaskError("must be a number or a regular (non-ragged) nested array") from None
    if array.size == 0 or not np.all(np.isfinite(array)):
        raise MaskError("must be non-empty and finite")
    if array.min() < 0 or array.max() > 1:
        raise MaskError("values must be in [0, 1]")
    while array.ndim > 0 and array.shape[0] == 1:
        array = array[0]
    return array


def video_mask(value: object, latent_t: int, latent_h: int, latent_w: int) -> LatentMask | None:
    """The full (T, H, W) grid of a video mask; None for an all-1 mask."""
    array = _values(value)
    token = (latent_t, latent_h // 2, latent_w // 2)
    if array.ndim == 0:
        grid = np.full((latent_t, latent_h, latent_w), float(array))
    elif array.shape in (token, (math.prod(token),)):
        grid = array.reshape(token).repeat(2, axis=1).repeat(2, axis=2)
    elif array.shape == (latent_t, latent_h, latent_w):
        grid = array
    else:
        raise MaskError(
            f"shape must be a scalar, ({math.prod(token)},) flat, {token} tokens or "
            f"{(latent_t, latent_h, latent_w)} latent cells (latent frames, height/16, width/16), "
            f"got {tuple(array.shape)}"
        )
    return None if np.all(grid == 1) else LatentMask.of(grid)


def audio_mask(value: object, audio_t: int) -> LatentMask | None:
    """The (2, A) grid of an audio mask; None for an all-1 mask."""
    array = _values(value)
    channels = limits.AUDIO_CHANNELS
    if array.ndim == 0:
        grid = np.full((channels, audio_t), float(array))
    elif array.shape == (audio_t,):
        grid = np.stack([array] * channels)
    elif array.shape in ((channels, audio_t), (channels * audio_t,)):
        grid = array.reshape(channels, audio_t)
    else:
        raise MaskError(
            f"shape must be a scalar, ({audio_t},), ({channels}, {audio_t}) or ({channels * audio_t},) "
            f"(audio latents at 40 per second), got {tuple(array.shape)}"
        )
    return None if np.all(grid == 1) else LatentMask.of(grid)
