"""TeaCache on the DiT's block loop (`--cache-backend tea_cache`), as vLLM-Omni serves it for MiniMax-H3's FL2VA DiT.

Per forward, the signal is block 0's modulated input over the whole packed sequence (text, conditions, audio and
video rows): norm1(x)·(1 + scale) + shift, each row modulated by its (timestep, modality) pair, so video and audio
share one decision and their sigmas enter only through the modulation. The decision (vLLM-Omni's `hook.py`):

- the relative L1 change d = mean|x − x_prev| / (mean|x_prev| + 1e-8) is rescaled by the fitted polynomial and
  |poly(d)| is added to an accumulator;
- while the accumulator is below `rel_l1_thresh` the step reuses the block residual of the last computed step
  (added to the current input); otherwise the accumulator resets to 0 and every block runs;
- always computed: a request's first forward, one with no previous signal or a different shape, and the forward a
  forced refresh names (`extra_params.force_refresh_step_hint`, h3serve.rules.cache_refresh); no forced last step;
- sequence-parallel ranks each judge their own rows, then MAX-reduce the decision over the group, so every rank
  computes when any one must; a rank whose "reuse" was overruled resets its accumulator.

Everything after the loop (the output norm with the current time embedding, both heads, the update masks) runs
every forward. The state lives for one request (`tea_cache`), so no request sees another's residual.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from h3serve.accel.cache_profile import TeaCacheProfile
from h3serve.model.pipeline_types import CacheStats
from h3serve.model.transformer import H3Transformer, StepModulation
from h3serve.rules.cache_refresh import ForceRefresh

EPS = 1e-8


@dataclass
class TeaCacheState:
    """One request's TeaCache bookkeeping: the accumulator, the last signal, the last computed residual."""

    profile: TeaCacheProfile
    refresh: ForceRefresh | None = None
    accumulated: float = 0.0
    forward: int = 0  # forwards seen so far
    previous: torch.Tensor | None = None  # the last forward's signal (kept in the signal's dtype)
    residual: torch.Tensor | None = None  # block output - block input of the last computed forward
    decisions: list[bool] = field(default_factory=list)  # per forward: True computed, False reused
    changes: list[float] = field(default_factory=list)  # per forward after the first: d (the raw relative L1)

    def wants_compute(self, signal: torch.Tensor) -> bool:
        """This rank's decision for the forward whose signal is `signal`; updates the accumulator and the signal."""
        previous, self.previous = self.previous, signal
        fresh = self.forward == 0 or (self.refresh is not None and self.refresh.refreshes(self.forward))
        if fresh or previous is None or previous.shape != signal.shape or self.residual is None:
            self.accumulated = 0.0
            return True
        # Means over every element in fp32, whatever the compute dtype (bf16 sums would round away small changes).
        change = ((signal.float() - previous.float()).abs().mean() / (previous.float().abs().mean() + EPS)).item()
        self.changes.append(change)
        self.accumulated += abs(self.profile.rescale(change))
        if self.accumulated < self.profile.rel_l1_thresh:
            return False
        self.accumulated = 0.0
        return True

    def decide(self, signal: torch.Tensor, agree: Agreement | None = None) -> bool:
        """The decision every rank runs: this rank's (`wants_compute`), then the group's (`agree`: True when any
        rank must compute). A rank whose "reuse" the group overrules computes too, so its accumulator restarts."""
        local = self.wants_compute(signal)
        agreed = local if agree is None else agree(local)
        if agreed and not local:
            self.accumulated = 0.0
        self.forward += 1
        self.decisions.append(agreed)
        return agreed


Agreement = Callable[[bool], bool]  # one rank's decision -> the group's


def any_rank(group: ProcessGroup | None, device: torch.device) -> Agreement | None:
    """The sequence-parallel group's agreement: MAX over the ranks' decisions (compute if any must); None for a
    group of one."""
    if group is None or dist.get_world_size(group) == 1:
        return None

    def agree(local: bool) -> bool:
        flag = torch.tensor([int(local)], dtype=torch.int32, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        return bool(flag.item())

    return agree


class TeaCacheLoop:
    """The `BlockLoop` TeaCache installs on the DiT for one request (h3serve.model.transformer)."""

    def __init__(self, state: TeaCacheState, group: ProcessGroup | None = None):
        self.state = state
        self.group = group  # the sequence-parallel group (None: one rank holds every row)

    def __call__(
        self,
        dit: H3Transformer,
        x: torch.Tensor,
        temb: torch.Tensor | StepModulation,
        adaln_idx: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        state = self.state
        signal = dit.transformer_blocks[0].modulated_input(x, temb, adaln_idx)
        compute = state.decide(signal, any_rank(self.group, x.device))
        if not compute:
            return x + state.residual
        out = dit.run_blocks(x, temb, adaln_idx, rotary)
        state.residual = out - x
        return out

    def stats(self, blocks: int) -> CacheStats:
        reused = self.state.decisions.count(False)
        return CacheStats(evaluated=self.state.decisions.count(True) * blocks, skipped=reused * blocks,
                          cached_steps=reused)


@contextmanager
def tea_cache(
    dit: H3Transformer,
    profile: TeaCacheProfile,
    refresh: ForceRefresh | None = None,
    group: ProcessGroup | None = None,
) -> Iterator[CacheStats]:
    """TeaCache on `dit` for one request; the stats are filled in when the block ends, and the DiT is back to its
    plain loop afterwards, even on error."""
    if dit.block_loop is not None:
        raise RuntimeError("the DiT already runs under a step cache")
    loop = TeaCacheLoop(TeaCacheState(profile, refresh), group)
    stats = CacheStats()
    dit.block_loop = loop
    try:
        yield stats
    finally:
        dit.block_loop = None
        done = loop.stats(len(dit.transformer_blocks))
        stats.evaluated, stats.skipped, stats.cached_steps = done.evaluated, done.skipped, done.cached_steps
