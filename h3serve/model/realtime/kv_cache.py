"""The clean K/V cache of a real-time session: per DiT block, the keys and values of earlier chunks' media rows.

After a chunk's three denoise steps one more forward at σ = 0 recomputes its keys and values from its clean latents;
each block stages its media rows (post-norm, post-RoPE, this rank's head shard after the Ulysses exchange) right after
the history, and `commit` makes them part of it. Retention (`h3serve.rules.realtime_geometry.kept_after_commit`) keeps
the first chunk's video rows as a sink plus the two most recent chunks, and `drop_audio` implements the reset every 12
requests. The buffers are allocated once, at the bound the rules compute (`kv_rows_bound`), so the cache's device bytes
are exactly the planner's figure for the whole session.
"""

from __future__ import annotations

import torch

from h3serve.rules.realtime_geometry import CachedChunk, Keep, apply_keep, kept_after_commit, kept_without_audio


class CleanKVCache:
    """K and V buffers [layers, capacity, heads, head_dim], the first `rows` of each the committed history."""

    def __init__(
        self, layers: int, heads: int, head_dim: int, capacity: int, dtype: torch.dtype, device: torch.device
    ):
        self.keys = torch.empty((layers, capacity, heads, head_dim), dtype=dtype, device=device)
        self.values = torch.empty_like(self.keys)
        self.chunks: tuple[CachedChunk, ...] = ()  # the history's chunks, in row order
        self.staged: list[int | None] = [None] * layers  # rows each layer staged for the commit in progress

    @property
    def rows(self) -> int:
        return sum(c.rows for c in self.chunks)

    @property
    def capacity(self) -> int:
        return self.keys.shape[1]

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes

    def history(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `layer`'s history [1, rows, heads, head_dim], K and V (views of the buffers)."""
        rows = self.rows
        return self.keys[layer, None, :rows], self.values[layer, None, :rows]

    def stage(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Layer `layer`'s clean media rows [1, n, heads, head_dim], written right after the history."""
        if self.staged[layer] is not None:
            raise RuntimeError(f"block {layer} staged its clean K/V twice in one commit")
        start, count = self.rows, keys.shape[1]
        if start + count > self.capacity:
            raise RuntimeError(f"the clean K/V cache holds {self.capacity} rows; {start} + {count} do not fit")
        self.keys[layer, start : start + count] = keys[0]
        self.values[layer, start : start + count] = values[0]
        self.staged[layer] = count

    def commit(self, chunk: CachedChunk) -> None:
        """The staged rows (every layer's, `chunk`'s rows) join the history; retention applies at once."""
        if any(count != chunk.rows for count in self.staged):
            raise RuntimeError(f"a clean commit of {chunk.rows} rows, but the layers staged {self.staged}")
        self.staged = [None] * len(self.staged)
        self.chunks = (*self.chunks, chunk)
        self._keep(kept_after_commit(len(self.chunks)))

    def rollback(self) -> None:
        """Forget a partial stage (a failed clean pass)."""
        self.staged = [None] * len(self.staged)

    def drop_audio(self) -> None:
        """Remove every audio row, keeping every video row (the periodic audio reset)."""
        self._keep(kept_without_audio(len(self.chunks)))

    def _keep(self, keep: Keep) -> None:
        """Compact the buffers to the chunks `keep` names (whole, or their video rows only), moved to the front in
        order."""
        starts = [0]
        for chunk in self.chunks:
            starts.append(starts[-1] + chunk.rows)
        position = 0
        for index, video_only in keep:
            chunk = self.chunks[index]
            skip = chunk.audio_rows if video_only else 0  # a chunk's audio rows come before its video rows
            source, length = starts[index] + skip, chunk.rows - skip
            if source != position:  # moves go forward within one buffer: copy the rows out first
                self.keys[:, position : position + length] = self.keys[:, source : source + length].clone()
                self.values[:, position : position + length] = self.values[:, source : source + length].clone()
            position += length
        self.chunks = apply_keep(self.chunks, keep)
