"""Latent-mask editing arithmetic (pure torch): which target cells are generated and which stay the source's.

Per modality, with the mask `m` per row (a video token's is the max over its 2x2 cells, rounded up to 1/256),
the restore mask `r` per cell, the clean source rows `c` and an anchor `a` (video: 0.999·c + 0.001·noise,
audio: c), each step at sigma s (t = 1 - s):
- the model reads `a + m·(state - a)` for the target rows, at timestep `min(1 - m·s, condition_t)`
  (condition_t = max(t, 0.999) for video, 1.0 for audio): a kept token looks like a clean condition token;
- the clean estimate is `lerp(c, x0(model input, m·v, t), r)`, and the Euler step starts from the un-blended
  state, so cells with r = 0 are the source's after every step, the last one included (it returns the estimate).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from h3serve.model.layout import patchify
from h3serve.model.scheduler import scale_noise
from h3serve.rules import limits

MASK_QUANTUM = 256  # the model mask is rounded up to 1/256 (few distinct timesteps, never below the raw mask)


def quantise_up(mask: torch.Tensor) -> torch.Tensor:
    return torch.ceil(mask * MASK_QUANTUM) / MASK_QUANTUM


@dataclass
class MaskedTarget:
    """One modality's edit, in packed target rows."""

    clean: torch.Tensor  # [N, F] normalised source latents
    model_mask: torch.Tensor  # [N]
    restore_mask: torch.Tensor  # [N, F]
    video: bool  # video: noise-augmented anchor and condition_t = max(t, 0.999); audio: clean anchor, 1.0
    anchor: torch.Tensor | None = None

    def set_anchor(self, noise: torch.Tensor) -> None:
        """`noise`: the target's initial noise rows [N, F], as drawn for this request."""
        self.anchor = scale_noise(self.clean, limits.KEYFRAME_NOISE_AUG_T, noise) if self.video else self.clean

    def to(self, device: torch.device) -> MaskedTarget:
        moved = [x.to(device) for x in (self.clean, self.model_mask, self.restore_mask)]
        anchor = None if self.anchor is None else self.anchor.to(device)
        return MaskedTarget(*moved, video=self.video, anchor=anchor)

    def model_input(self, state: torch.Tensor) -> torch.Tensor:
        return self.anchor + self.model_mask[:, None] * (state - self.anchor)

    def row_times(self, t: float) -> torch.Tensor:
        """Per-row timesteps [N] fp32 at grid point t (sigma = 1 - t)."""
        condition_t = max(t, limits.KEYFRAME_NOISE_AUG_T) if self.video else 1.0
        return torch.clamp(1.0 - self.model_mask.float().cpu() * (1.0 - t), max=condition_t)

    def clean_estimate(self, model_input: torch.Tensor, velocity: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        x0 = model_input + (1 - t) * (self.model_mask[:, None] * velocity)  # sigma from t, as the scheduler
        return torch.lerp(self.clean, x0, self.restore_mask)


def video_target(clean: torch.Tensor, grid: torch.Tensor) -> MaskedTarget:
    """clean [1, C, T, H, W] normalised latents, grid [T, H, W] mask -> packed rows (frame, h, w per token)."""
    channels = clean.shape[1]
    token_mask = F.max_pool2d(grid[:, None].float(), kernel_size=2)[:, 0]  # [T, H/2, W/2]
    restore = patchify(grid[None, None].float().expand(1, channels, *grid.shape))
    return MaskedTarget(patchify(clean), quantise_up(token_mask.reshape(-1)), restore, video=True)


def audio_target(clean: torch.Tensor, grid: torch.Tensor) -> MaskedTarget:
    """clean [2·A, 32] channel-major rows, grid [2, A] mask -> rows."""
    flat = grid.reshape(-1).float()
    return MaskedTarget(clean, quantise_up(flat), flat[:, None].expand(-1, clean.shape[1]).contiguous(), video=False)
