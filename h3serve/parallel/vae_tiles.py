"""VAE tile parallelism: the video decode's (temporal chunk, tile row, tile column) units spread over ranks.

`AutoencoderKLMiniMaxH3._decode` decodes temporal chunks one after another, each as a grid of spatial tiles
blended together, and cross-fades the chunks. Here the same units, in the same order, are dealt round-robin
to the ranks; each rank decodes its own, rank 0 gathers them all and then runs the VAE's own stitching and
blending code once, in the single-rank order. Per-tile decoding is the same computation either way, so the
result is bit-identical to a one-rank tiled decode. Ranks other than 0 return zero frames: only rank 0's
result leaves the engine.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from h3serve.model.tile_stitch import stitch, tile_grid
from h3serve.parallel.comm import group_rank, group_size

_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


class TileParallelDecode:
    """Drop-in for `vae._decode` (installed on the instance, so `vae.decode` keeps its dtype handling)."""

    def __init__(self, vae: nn.Module, group: ProcessGroup | None):
        self.vae = vae
        self.group = group

    @classmethod
    def install(cls, vae: nn.Module, group: ProcessGroup | None) -> TileParallelDecode:
        decode = cls(vae, group)
        vae._decode = decode
        # The streamed decode (h3serve.model.stream_decode) asks for one clip at a time.
        vae._decode_clip = decode.decode_clip
        return decode

    def decode_clip(self, z: torch.Tensor) -> torch.Tensor | None:
        """One temporal clip, its tiles spread over the ranks: rank 0 gets the clip stitched in place (the VAE's
        own `_decode_clip` result, bit for bit), the other ranks None once they have sent their tiles."""
        vae = self.vae
        z = z.contiguous()
        if self.group is not None:  # every rank tiles rank 0's latents
            dist.broadcast(z, src=dist.get_global_rank(self.group, 0), group=self.group)
        windows, columns, y_overlaps, x_overlaps = tile_grid(vae, z)
        tiles = self._decode_tiles([z], windows)
        if not tiles:
            return None
        return stitch(tiles, columns, y_overlaps, x_overlaps)

    def _decode_tiles(self, clips: list[torch.Tensor], windows: list[tuple[slice, slice]]) -> list[torch.Tensor]:
        """Decode this rank's share of the units; rank 0 gets all of them in unit order, other ranks none."""
        vae, size, rank = self.vae, group_size(self.group), group_rank(self.group)
        units = [(c, w) for c in range(len(clips)) for w in range(len(windows))]
        mine = [
            vae.decoder(vae.post_quant_conv(clips[c][..., windows[w][0], windows[w][1]])) for c, w in units[rank::size]
        ]
        if size == 1:
            return mine
        # Units all have one shape (equal tiles, equal clips); a rank with one unit fewer sends a zero filler,
        # so one fixed-shape gather collects everything. Rank 0 always owns unit 0; when some rank owns none
        # (more ranks than units), rank 0 tells it the unit's shape and dtype first.
        shape, dtype = (mine[0].shape, mine[0].dtype) if mine else (None, None)
        if len(units) < size:
            shape, dtype = self._share_unit_meta(shape, dtype, clips[0].device)
        per_rank = -(-len(units) // size)
        local = torch.zeros((per_rank, *shape), dtype=dtype, device=clips[0].device)
        for i, tile in enumerate(mine):
            local[i] = tile
        gathered = [torch.empty_like(local) for _ in range(size)] if rank == 0 else None
        dist.gather(local, gathered, dst=dist.get_global_rank(self.group, 0), group=self.group)
        if rank != 0:
            return []
        return [gathered[u % size][u // size] for u in range(len(units))]

    def _share_unit_meta(
        self, shape: torch.Size | None, dtype: torch.dtype | None, device: torch.device
    ) -> tuple[torch.Size, torch.dtype]:
        header = torch.zeros(6, dtype=torch.int64, device=device)
        if shape is not None:
            header[:5] = torch.tensor(shape)
            header[5] = _DTYPES.index(dtype)
        dist.broadcast(header, src=dist.get_global_rank(self.group, 0), group=self.group)
        return torch.Size(header[:5].tolist()), _DTYPES[int(header[5])]

    def __call__(self, z: torch.Tensor) -> torch.Tensor:
        vae = self.vae
        if self.group is not None:
            # Every rank must tile the same latents; rank 0's are the ones whose result is returned.
            z = z.contiguous()
            dist.broadcast(z, src=dist.get_global_rank(self.group, 0), group=self.group)
        # --- the temporal chunking of AutoencoderKLMiniMaxH3._decode, unchanged -----------------------------
        tokens_chunk_size = vae.tokens_chunk_size
        token_drop = vae.config.token_drop
        temporal_ratio = vae.temporal_compression_ratio
        chunk_num_frames = tokens_chunk_size * temporal_ratio
        num_tokens = z.shape[2] + token_drop
        pad_tokens = (-num_tokens) % tokens_chunk_size
        num_chunks = (num_tokens + pad_tokens) // tokens_chunk_size - int(token_drop > 0)
        if pad_tokens > 0:
            z = torch.cat([z, z[:, :, -1:].repeat(1, 1, pad_tokens, 1, 1)], dim=2)
        clips_in = [
            z[:, :, i * tokens_chunk_size : i * tokens_chunk_size + tokens_chunk_size + vae.token_overlap]
            for i in range(num_chunks)
        ]
        windows, columns, y_overlaps, x_overlaps = tile_grid(vae, clips_in[0])
        tiles = self._decode_tiles(clips_in, windows)
        if not tiles:
            b, _, _, h, w = z.shape
            ratio = vae.spatial_compression_ratio
            return z.new_zeros((b, vae.config.out_channels, 0, h * ratio, w * ratio))

        per_clip = len(windows)
        decoded_chunks = []
        overlap = None
        for i in range(num_chunks):
            units = tiles[i * per_clip : (i + 1) * per_clip]
            if vae.use_tiling:
                rows = [units[r : r + columns] for r in range(0, per_clip, columns)]
                clip = vae._stitch_tiles(rows, y_overlaps, x_overlaps)
            else:
                clip = units[0]
            for j in range(int(token_drop > 0) + 1):
                frame_start = j * chunk_num_frames
                chunk = clip[:, :, frame_start : frame_start + chunk_num_frames]
                chunk = chunk[:, :, vae.frame_pre_padding :]
                if j == 0:
                    if overlap is not None:
                        chunk = vae._blend(overlap, chunk, vae.frame_overlap, dim=-3)
                    decoded_chunks.append(chunk)
                else:
                    overlap = chunk
        if overlap is not None:
            decoded_chunks.append(overlap)
        dec = torch.cat(decoded_chunks, dim=2)
        if pad_tokens > 0:
            intra_tail = vae.config.clip_length % temporal_ratio
            num_tokens_before_pad = z.shape[2] - pad_tokens
            pad_frames = sum(
                intra_tail if intra_tail and (num_tokens_before_pad + k) % tokens_chunk_size == 0 else temporal_ratio
                for k in range(pad_tokens)
            )
            dec = dec[:, :, :-pad_frames]
        return dec
