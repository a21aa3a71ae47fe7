"""Rectified-flow Euler schedule of MiniMax-H3 (spec §4).

Conventions: t = 1 - sigma and t = 1 is clean; the model predicts a data-ward velocity (x0 = x_t + sigma·v).
`steps` = N counts denoiser forwards (vLLM-Omni's meaning): N + 1 sigma points including the terminal 0, which
is diffusers' MiniMaxH3Scheduler at `num_inference_steps = N + 1`, bit for bit. See h3serve/schedule.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class FlowSchedule:
    sigmas: torch.Tensor  # [N + 1] fp32, strictly decreasing, ending at 0
    timesteps: torch.Tensor  # [N] fp32, t = 1 - sigma: one per forward

    @classmethod
    def shifted(cls, steps: int, shift: float, positions: tuple[float, ...] | None = None) -> FlowSchedule:
        """sigma = s·b / (1 + (s - 1)·b) over b = linspace(1, 0, N + 1) in fp32 on the CPU (consecutive
        duplicates collapsed, as the reference does), or over pinned `positions` (len N + 1; never collapsed)."""
        if shift <= 0:
            raise ValueError(f"shift must be positive, got {shift}")
        if steps < 1:
            raise ValueError(f"steps counts denoiser forwards and must be >= 1, got {steps}")
        if positions is None:
            base = torch.linspace(1.0, 0.0, int(steps) + 1, dtype=torch.float32)
            sigmas = torch.unique_consecutive(shift * base / (1 + (shift - 1) * base))
        else:
            if len(positions) != steps + 1:
                raise ValueError(f"{len(positions)} pinned positions do not make {steps} forwards")
            base = torch.tensor(positions, dtype=torch.float32)
            sigmas = shift * base / (1 + (shift - 1) * base)
            if not bool((sigmas[1:] < sigmas[:-1]).all()):
                raise ValueError(f"pinned positions {positions} collapse under shift {shift} in fp32")
        return cls(sigmas=sigmas, timesteps=1.0 - sigmas[:-1])

    def to(self, device: torch.device) -> FlowSchedule:
        """The same schedule on `device` (once per request: a step then reads it without a host copy)."""
        return FlowSchedule(sigmas=self.sigmas.to(device), timesteps=self.timesteps.to(device))

    def __len__(self) -> int:
        return self.timesteps.numel()

    def step(self, velocity: torch.Tensor, index: int, sample: torch.Tensor) -> torch.Tensor:
        """One Euler (eta = 0) step from grid point `index` to `index + 1`, blended in fp32."""
        t = self.timesteps[index].to(sample.device, sample.dtype)
        denoised = sample + (1 - t) * velocity  # sigma taken from t, as the reference does
        return self.step_from_x0(denoised, index, sample)

    def step_from_x0(self, denoised: torch.Tensor, index: int, sample: torch.Tensor) -> torch.Tensor:
        """The same Euler step given the clean estimate; at the last grid point (sigma 0) it returns `denoised`."""
        ratio = (self.sigmas[index + 1] / self.sigmas[index]).to(sample.device, torch.float32)
        out = ratio * sample.float() + (1.0 - ratio) * denoised.float()
        return out.to(sample.dtype)


def scale_noise(sample: torch.Tensor, t: float, noise: torch.Tensor) -> torch.Tensor:
    """Forward process at face-value t: t·x0 + (1 - t)·noise (used for condition anchors at t = 0.999)."""
    tt = torch.tensor(t, dtype=sample.dtype, device=sample.device)
    return tt * sample + (1.0 - tt) * noise
