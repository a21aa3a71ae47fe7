"""One VAE clip's spatial tiles stitched into one preallocated clip, bit for bit the VAE's own stitching.

`AutoencoderKLMiniMaxH3._stitch_tiles` keeps every decoded tile of the clip, blends each with the original tile
above (vertically) and then with the original tile to its left (horizontally, over the vertically blended
values), crops the trailing overlaps, concatenates each row and then the rows: the clip's tiles plus two more
copies of the clip. `stitch` takes the tiles in row-major order, one at a time (a generator may decode them as
they are asked for), and writes each into the output at once: alive are the output, the current tile and the
overlap strips later tiles blend with (the original tile's bottom rows for the row below, its right columns for
the tile to its right). Each blended value is the same `a·(1 - k/e) + b·(k/e)` of the same operands, so the clip
equals `_stitch_tiles`'s result exactly.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

Window = tuple[slice, slice]  # a tile's rows and columns on the latent grid


def tile_grid(vae: nn.Module, z: torch.Tensor) -> tuple[list[Window], int, list[int], list[int]]:
    """Latent-space tile windows of one clip `z` [B, C, t, h, w] (row-major), the number of tile columns and
    the pixel overlaps between rows and between columns (`_decode_clip`'s layout)."""
    ratio = vae.spatial_compression_ratio
    if not vae.use_tiling:
        return [(slice(None), slice(None))], 1, [], []
    ys, y_lens, y_overlaps = vae._split_tiles(
        z.shape[-2] * ratio, vae.tile_sample_min_height, vae.tile_sample_min_overlap_height
    )
    xs, x_lens, x_overlaps = vae._split_tiles(
        z.shape[-1] * ratio, vae.tile_sample_min_width, vae.tile_sample_min_overlap_width
    )
    windows = [
        (slice(i // ratio, i // ratio + h // ratio), slice(j // ratio, j // ratio + w // ratio))
        for i, h in zip(ys, y_lens, strict=True)
        for j, w in zip(xs, x_lens, strict=True)
    ]
    return windows, len(xs), y_overlaps, x_overlaps


def decode_clip(vae: nn.Module, z: torch.Tensor) -> torch.Tensor:
    """`vae._decode_clip(z)`, its tiles decoded one at a time and stitched in place."""
    windows, columns, y_overlaps, x_overlaps = tile_grid(vae, z)
    tiles = (vae.decoder(vae.post_quant_conv(z[..., ys, xs])) for ys, xs in windows)
    return stitch(tiles, columns, y_overlaps, x_overlaps)


def _blend_into(a: torch.Tensor, b: torch.Tensor, extent: int, dim: int) -> None:
    """`b`'s first `extent` slices along `dim` := the cross-fade from the end of `a` (`_blend`, in place)."""
    extent = min(a.shape[dim], b.shape[dim], extent)
    positions = torch.arange(extent, device=b.device, dtype=b.dtype)
    shape = [1] * b.ndim
    shape[dim] = extent
    weight_a = (1 - positions / extent).view(shape)
    weight_b = (positions / extent).view(shape)
    head = b.narrow(dim, 0, extent)
    head.copy_(a.narrow(dim, a.shape[dim] - extent, extent) * weight_a + head * weight_b)


def _strip(tile: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    """A copy of the tile's last `width` slices along `dim` (kept before the tile is blended in place)."""
    return tile.narrow(dim, tile.shape[dim] - width, width).clone()


def stitch(tiles: Iterable[torch.Tensor], columns: int, y_overlaps: list[int], x_overlaps: list[int]) -> torch.Tensor:
    """The tiles [B, C, t, th, tw] of a `len(y_overlaps) + 1` × `columns` grid, row-major, as one clip.

    Tiles are blended in place: pass tensors the caller no longer needs (freshly decoded ones)."""
    it: Iterator[torch.Tensor] = iter(tiles)
    rows = len(y_overlaps) + 1
    if rows == columns == 1:
        return _next_tile(it, 1)
    out = None
    above: list[torch.Tensor | None] = [None] * columns  # original bottom strips of the previous row's tiles
    y0 = 0
    for i in range(rows):
        left: torch.Tensor | None = None  # the original right strip of the tile to the left
        x0, height = 0, 0
        for j in range(columns):
            tile = _next_tile(it, rows * columns)
            if out is None:
                th, tw = tile.shape[-2:]
                out = tile.new_empty((*tile.shape[:-2], rows * th - sum(y_overlaps), columns * tw - sum(x_overlaps)))
            bottom = _strip(tile, y_overlaps[i], -2) if i < rows - 1 else None
            right = _strip(tile, x_overlaps[j], -1) if j < columns - 1 else None
            if i > 0:
                _blend_into(above[j], tile, y_overlaps[i - 1], dim=-2)
            if j > 0:
                _blend_into(left, tile, x_overlaps[j - 1], dim=-1)
            height = tile.shape[-2] - (y_overlaps[i] if i < rows - 1 else 0)
            width = tile.shape[-1] - (x_overlaps[j] if j < columns - 1 else 0)
            out[..., y0 : y0 + height, x0 : x0 + width] = tile[..., :height, :width]
            above[j], left = bottom, right
            x0 += width
            del tile
        y0 += height
    return out


def _next_tile(tiles: Iterator[torch.Tensor], expected: int) -> torch.Tensor:
    tile = next(tiles, None)
    if tile is None:
        raise ValueError(f"fewer tiles than the grid's {expected}")
    return tile
