"""Sequence parallelism over the packed rows: Ulysses, Ring, or their hybrid on U×R ranks (USP).

The DiT calls `shard` before its block loop and `gather` after it (see `H3Transformer.forward`); every
block's attention core is `attention`. The packed length S is padded to a multiple of U·R and rank
`ring·U + ulysses` runs chunk `ring·U + ulysses` of the rows through the blocks. Inside attention, Ulysses
first gathers its group's U chunks (one contiguous segment of U·c rows) for 1/U of the heads; Ring then
circulates the segments of the R ring peers. Padded rows sit at the end of the sequence, so each segment's
real keys are a prefix of it and padded keys are cut off, never attended: the result is exact for every S.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup

from h3serve.accel.attention import BACKENDS, DEFAULT, Backend
from h3serve.parallel.comm import all_gather_dim, group_rank, group_size
from h3serve.parallel.ring import ring_attention
from h3serve.parallel.ulysses import gather_heads, scatter_heads


@dataclass
class SequenceParallel:
    """One rank's sequence-parallel state. `None` groups mean degree 1."""

    ulysses_group: ProcessGroup | None
    ring_group: ProcessGroup | None
    sp_group: ProcessGroup | None  # all U·R ranks, in chunk order
    seq_len: int = 0  # S of the forward in flight (set by `shard`)
    chunk: int = 0  # rows per rank
    backend: Backend = BACKENDS[DEFAULT]  # the `self` role's kernel: whole (Ulysses) or partial (ring)

    @property
    def ulysses(self) -> int:
        return group_size(self.ulysses_group)

    @property
    def ring(self) -> int:
        return group_size(self.ring_group)

    @property
    def index(self) -> int:
        """This rank's chunk of the padded sequence."""
        return group_rank(self.ring_group) * self.ulysses + group_rank(self.ulysses_group)

    def install(self, transformer: nn.Module, backend: Backend) -> None:
        """Make `transformer` (an H3Transformer) run its blocks sequence-parallel, with `backend`'s kernels
        (h3serve.accel.attention). The token refiner only sees the text rows and stays whole on every rank."""
        if self.ring_group is not None and backend.with_lse is None:
            raise ValueError("ring attention needs an attention backend with a log-sum-exp kernel")
        self.backend = backend
        transformer.sequence_parallel = self
        for block in transformer.transformer_blocks:
            block.attn.attention_fn = self.attention

    # -- around the block loop -------------------------------------------------------------------------------

    def shard(
        self, x: torch.Tensor, adaln_idx: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """Full rows (x [B, S, D], adaln_idx [S], rotary cos/sin [S, r]) -> this rank's chunk of each."""
        degree = self.ulysses * self.ring
        s = x.shape[1]
        c = -(-s // degree)
        pad = c * degree - s
        self.seq_len, self.chunk = s, c
        rows = slice(self.index * c, (self.index + 1) * c)
        # Padded rows are zeros (index 0 for the AdaLN lookup): finite, never attended to, dropped by `gather`.
        x = F.pad(x, (0, 0, 0, pad))[:, rows]
        adaln_idx = F.pad(adaln_idx, (0, pad))[rows]
        cos, sin = (F.pad(t, (0, 0, 0, pad))[rows] for t in rotary)
        return x, adaln_idx, (cos, sin)

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's chunk [B, c, D] -> every row [B, S, D] (on every rank)."""
        return all_gather_dim(x, 1, self.sp_group)[:, : self.seq_len]

    # -- attention core --------------------------------------------------------------------------------------

    def _real_keys(self, segment: int) -> int:
        """Real (unpadded) rows at the start of Ulysses segment `segment` (= ring rank)."""
        size = self.ulysses * self.chunk
        return max(0, min(size, self.seq_len - segment * size))

    @torch.compiler.disable  # communication and ring bookkeeping stay eager inside a compiled block
    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q, k, v [B, c, H_local, Dh] of this rank's rows -> attention output for the same rows and heads."""
        dh = q.shape[-1]
        # One all-to-all for q, k and v together: concatenated on the feature dim, split after.
        qkv = scatter_heads(torch.cat([q, k, v], dim=-1), self.ulysses_group)  # [B, U·c, H/U, 3·Dh]
        q, k, v = qkv.split(dh, dim=-1)  # [B, U·c, H/U, Dh]
        if self.ring_group is not None:
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, H/U, U·c, Dh]
            out = ring_attention(q, k, v, self.ring_group, self._real_keys, self.backend.with_lse).transpose(1, 2)
        else:  # the segment's real keys are a prefix of it
            n = self._real_keys(0)
            out = self.backend.fn(q, k[:, :n], v[:, :n])
        return gather_heads(out, self.ulysses_group)
