"""Mask JSON intake: the size, encoding, nesting and null rules (shapes and values: tests/test_validate.py)."""

from __future__ import annotations

import numpy as np
import pytest

from h3serve.rules import limits
from h3serve.rules.edit_mask import LatentMask, MaskError, audio_mask, parse_mask_json, video_mask


def test_parse_mask_json_rules():
    assert parse_mask_json(b"[[0.5, 1]]") == [[0.5, 1]] and parse_mask_json("0") == 0
    for raw, message in [
        (b" ", "is empty"),
        (b"null", "must not be null"),
        (b"\xff\xfe", "UTF-8"),
        (b"[0.5,", "invalid JSON or is nested too deeply"),
        (b"[" * 64 + b"0" + b"]" * 64, "nested too deeply"),
        (b" " * (limits.MAX_MASK_BYTES + 1), "exceeds the 8 MiB limit"),
    ]:
        with pytest.raises(MaskError, match=message):
            parse_mask_json(raw)
    assert parse_mask_json(b"[" * 63 + b"0" + b"]" * 63) is not None


def test_latent_mask_round_trips_and_compares():
    grid = np.linspace(0, 1, 2 * 7, dtype=np.float32).reshape(2, 7)
    mask = LatentMask.of(grid)
    assert np.array_equal(mask.array(), grid) and mask == LatentMask.of(grid.copy()) and hash(mask)
    assert audio_mask([[1.0] * 7, [1.0] * 7], 7) is None and video_mask(1.0, 3, 2, 2) is None
    with pytest.raises(MaskError, match="numbers only"):
        video_mask(["0.5"], 3, 2, 2)
