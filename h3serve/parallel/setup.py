"""What one rank applies: its process groups, how it loads its shards, and the hooks it installs.

`ModelRunner` builds a `RankParallel` after `init_process_group` and before loading anything:
  - `dit_tp` is passed to `load_transformer` (sharded modules, sliced reads);
  - the text encoder loads sharded on the first N ranks (h3serve.loading.text_encoder_shards);
  - `install` wires sequence parallelism into each DiT and tile parallelism into the video VAE.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from h3serve.accel.attention import Backend
from h3serve.parallel.degrees import ParallelDegrees
from h3serve.parallel.sequence import SequenceParallel
from h3serve.parallel.tensor_parallel import TensorParallel
from h3serve.parallel.vae_tiles import TileParallelDecode

if TYPE_CHECKING:
    from h3serve.model.pipeline_types import H3Components


def _new_groups(degrees: ParallelDegrees, rank: int, axes: tuple[str, ...]) -> ProcessGroup | None:
    """Create the groups along `axes` (one per combination of the other coordinates); return this rank's.

    `new_group` is collective over the whole world: every rank creates every group, in the same order.
    """
    sizes = {"tp": degrees.tensor_parallel, "ulysses": degrees.ulysses, "ring": degrees.ring}
    if all(sizes[a] == 1 for a in axes):
        return None
    mine, seen = None, set()
    for r in range(degrees.world_size):
        ranks = tuple(degrees.group_ranks(r, axes))
        if ranks in seen:
            continue
        seen.add(ranks)
        group = dist.new_group(list(ranks))
        if rank in ranks:
            mine = group
    return mine


@dataclass
class RankParallel:
    """One rank's groups and strategies; `None` where a degree is 1."""

    degrees: ParallelDegrees
    rank: int
    dit_tp: TensorParallel | None
    sequence: SequenceParallel | None
    text_tp: TensorParallel | None  # this rank's text-encoder shard (first N ranks, N > 1)
    vae_group: ProcessGroup | None

    @classmethod
    def build(cls, degrees: ParallelDegrees, rank: int) -> RankParallel:
        """Collective: every rank calls this once, after `init_process_group`."""
        if dist.get_world_size() != degrees.world_size:
            raise ValueError(f"the process group has {dist.get_world_size()} ranks, the layout {degrees.world_size}")
        from h3serve.model.transformer import H3Transformer
        from h3serve.parallel.text_encoder_tp import TEXT_ENCODER_TP_PLAN

        tp_group = _new_groups(degrees, rank, ("tp",))
        ulysses_group = _new_groups(degrees, rank, ("ulysses",))
        ring_group = _new_groups(degrees, rank, ("ring",))
        # With one sequence axis, its group is the sequence group: one communicator carries the attention's
        # exchanges and the DLO all-gather in program order, so the gather may overlap a block's compute.
        if degrees.ring == 1 or degrees.ulysses == 1:
            sp_group = ulysses_group if degrees.ring == 1 else ring_group
        else:
            sp_group = _new_groups(degrees, rank, ("ulysses", "ring"))
        n_text = degrees.text_encoder_tp
        text_group = dist.new_group(list(range(n_text))) if n_text > 1 else None
        me = degrees.coords(rank)
        dit_tp = (
            TensorParallel(me.tp, degrees.tensor_parallel, tp_group, H3Transformer.tensor_parallel_plan)
            if degrees.tensor_parallel > 1
            else None
        )
        runs_text_shard = 1 < n_text and rank < n_text
        text_tp = TensorParallel(rank, n_text, text_group, TEXT_ENCODER_TP_PLAN) if runs_text_shard else None
        sequence = SequenceParallel(ulysses_group, ring_group, sp_group) if degrees.sequence_parallel > 1 else None
        vae_group = dist.group.WORLD if degrees.vae_patch_parallel > 1 else None
        return cls(degrees, rank, dit_tp, sequence, text_tp, vae_group)

    @property
    def one_denoise_communicator(self) -> bool:
        """Whether every collective of the DiT blocks runs on the sequence group's one communicator (no tensor
        parallelism, one sequence axis): then a DLO all-gather may run while a block computes, ordered with the
        blocks' exchanges on that communicator instead of concurrently on another (which NCCL says can hang)."""
        d = self.degrees
        return self.dit_tp is None and (d.ring == 1 or d.ulysses == 1)

    @property
    def runs_text_encoder(self) -> bool:
        return self.rank < self.degrees.text_encoder_tp

    @property
    def runs_encoder_whole(self) -> bool:
        """Rank 0 without text-encoder TP runs the unsharded encoder, loaded the usual way."""
        return self.degrees.text_encoder_tp == 1 and self.rank == 0

    def install(self, components: H3Components, attention: Backend) -> None:
        """Sequence parallelism (with the DiT blocks' attention backend) into every loaded DiT, tile parallelism
        into the video VAE."""
        for dit in (components.transformer, components.transformer_ref):
            if dit is not None:
                self.install_dit(dit, attention)
        if self.vae_group is not None:
            TileParallelDecode.install(components.vae, self.vae_group)

    def install_dit(self, dit: torch.nn.Module, attention: Backend) -> None:
        """One DiT (its TP shard already loaded): sequence parallelism with `attention`'s kernels, and rank 0's
        rows for every rank of the DiT group."""
        if self.sequence is not None:
            self.sequence.install(dit, attention)
        if self.degrees.dit_group > 1:
            dit.register_forward_pre_hook(_same_rows_everywhere)


def _same_rows_everywhere(module: torch.nn.Module, args: tuple) -> tuple:
    """DiT forward pre-hook: rank 0's video and audio rows replace every rank's copy.

    Each rank builds the rows itself (noise, VAE-encoded keyframes and references). TP and SP assume the ranks
    hold identical replicated inputs; a VAE encode that differs in the last bit between GPUs would break that
    silently, so rank 0's rows are broadcast (a few MB per step). In place where possible, so the sampler's
    own copy agrees too.
    """
    video, audio, *rest = args
    video, audio = video.contiguous(), audio.contiguous()
    dist.broadcast(video, src=0)
    dist.broadcast(audio, src=0)
    return (video, audio, *rest)


def parameter_bytes(module: torch.nn.Module) -> int:
    """Bytes of parameters this rank holds (a TP shard holds about 1/TP of the sharded ones)."""
    return sum(p.numel() * p.element_size() for p in module.parameters())
