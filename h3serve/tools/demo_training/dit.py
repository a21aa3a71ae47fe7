"""Flow-matching training of a demo DiT on laid-out examples, with H3's objective.

The sampler (h3serve.model.scheduler) walks x_t = (1 - σ)·x0 + σ·ε from σ = 1 to 0 and reads the model's output as the
data-ward velocity v = x0 - ε (x0 = x_t + σ·v). Training draws one base position b ~ U(0, 1) per example and maps it
through each modality's released shift (video 12, audio 3), as one sampler step does for both modalities; condition
rows are noise-augmented at t = 0.999 and reference/guide audio rows are clean, exactly as `H3Pipeline._initial_rows`
and `Layout.row_times` lay them out. The loss is the velocity MSE on the generated rows only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from h3serve import limits
from h3serve.model.scheduler import scale_noise
from h3serve.model.transformer import H3Transformer
from h3serve.tools.demo_training.examples import Example

LossLog = Callable[[str, int, float], None]


def shifted(base: float, shift: float) -> float:
    """The released schedule's σ for base position `base` (h3serve.model.scheduler.FlowSchedule.shifted)."""
    return shift * base / (1 + (shift - 1) * base)


def example_loss(
    dit: H3Transformer,
    example: Example,
    generator: torch.Generator,
    base: float,
    video_shift: float,
    audio_shift: float,
) -> torch.Tensor:
    """The velocity MSE of one example at base position `base` (video and audio rows weighted alike)."""
    sigma_v, sigma_a = shifted(base, video_shift), shifted(base, audio_shift)
    eps_v = torch.randn(example.video.shape, generator=generator)
    eps_a = torch.randn(example.audio.shape, generator=generator)
    noisy_v = (1 - sigma_v) * example.video + sigma_v * eps_v
    noisy_a = (1 - sigma_a) * example.audio + sigma_a * eps_a
    conditions = example.conditions
    if conditions.numel():
        noise = torch.randn(conditions.shape, generator=generator)
        conditions = scale_noise(conditions, limits.KEYFRAME_NOISE_AUG_T, noise)
    video_rows = torch.cat([conditions, noisy_v])
    audio_rows = torch.cat([example.audio_references, noisy_a])
    timestep, row_index = example.layout.row_timesteps(1 - sigma_v, 1 - sigma_a, limits.KEYFRAME_NOISE_AUG_T)
    v_vel, a_vel = dit(video_rows[None], audio_rows[None], dit.embed_text(example.text_states), timestep, row_index,
                       example.layout.packed)
    nv, na = example.conditions.shape[0], example.audio_references.shape[0]
    video_loss = (v_vel[0, nv:] - (example.video - eps_v)).pow(2).mean()
    audio_loss = (a_vel[0, na:] - (example.audio - eps_a)).pow(2).mean()
    return video_loss + audio_loss


def train_dit(
    dit: H3Transformer,
    examples: Sequence[Example],
    steps: int,
    seed: int,
    log: LossLog,
    name: str,
    batch: int = 4,
    lr: float = 1e-3,
    video_shift: float = 12.0,
    audio_shift: float = 3.0,
) -> None:
    """AdamW with a one-cycle schedule over `steps` optimizer steps of `batch` examples each (one forward per
    example: their layouts differ); the examples are drawn uniformly."""
    rng = np.random.default_rng(seed)
    generator = torch.Generator().manual_seed(seed)
    dit.train().requires_grad_(True)
    optimizer = torch.optim.AdamW(dit.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.99))
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=lr, total_steps=steps, pct_start=0.05)
    for step in range(steps):
        total = 0.0
        for _ in range(batch):
            example = examples[int(rng.integers(len(examples)))]
            loss = example_loss(dit, example, generator, float(rng.random()), video_shift, audio_shift) / batch
            loss.backward()
            total += float(loss)
        torch.nn.utils.clip_grad_norm_(dit.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        schedule.step()
        log(name, step, total)
    dit.eval().requires_grad_(False)
