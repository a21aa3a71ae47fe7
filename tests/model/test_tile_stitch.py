"""Tiles stitched in place (h3serve.model.tile_stitch) against the VAE's own `_stitch_tiles` and `_decode_clip`."""

from __future__ import annotations

import pytest
import torch

from h3serve.model.tile_stitch import decode_clip, stitch, tile_grid


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "columns"), [(1, 1), (1, 3), (3, 1), (3, 4)])
def test_stitch_equals_the_vaes_stitching(tiny_pipeline, rows, columns, dtype):
    vae = tiny_pipeline[0].components.vae
    # Uneven overlaps (the VAE spreads its slack round-robin) and a corner blended both ways.
    y_overlaps = [6, 4][: rows - 1]
    x_overlaps = [5, 3, 7][: columns - 1]
    g = torch.Generator().manual_seed(rows * 10 + columns)
    grid = [[torch.randn((1, 3, 2, 12, 14), generator=g).to(dtype) for _ in range(columns)] for _ in range(rows)]
    expected = vae._stitch_tiles(grid, y_overlaps, x_overlaps)
    got = stitch((t.clone() for row in grid for t in row), columns, y_overlaps, x_overlaps)
    assert got.dtype == dtype and got.shape == expected.shape
    assert torch.equal(got, expected)


def test_decode_clip_equals_the_vaes_tiled_clip_decode(tiny_pipeline):
    vae = tiny_pipeline[0].components.vae
    saved = (
        vae.tile_sample_min_height,
        vae.tile_sample_min_width,
        vae.tile_sample_min_overlap_height,
        vae.tile_sample_min_overlap_width,
    )
    z = torch.randn((1, 24, 7, 5, 9), generator=torch.Generator().manual_seed(5))
    try:
        vae.enable_tiling(48, 64, 16, 16)  # 80 x 144 px: 2 rows x 3 columns with slack in the overlaps
        windows, columns, y_overlaps, x_overlaps = tile_grid(vae, z)
        assert (len(windows) // columns, columns) == (2, 3) and len(set(x_overlaps)) > 1
        with torch.no_grad():
            assert torch.equal(decode_clip(vae, z), type(vae)._decode_clip(vae, z))
    finally:
        vae.enable_tiling(*saved)


def test_no_tiles_is_refused():
    with pytest.raises(ValueError, match="fewer tiles than the grid.s 2"):
        stitch(iter([]), 2, [], [3])
