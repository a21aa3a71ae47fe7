"""Rectified-flow schedule of MiniMax-H3 (docs/model.md §4) and its solvers: Euler (eta 0) and RES multistep.

Conventions: t = 1 - sigma and t = 1 is clean; the model predicts a data-ward velocity (x0 = x_t + sigma·v).
`steps` = N counts denoiser forwards (vLLM-Omni's meaning): N + 1 sigma points including the terminal 0, which
is diffusers' MiniMaxH3Scheduler at `num_inference_steps = N + 1`, bit for bit. See h3serve/rules/schedule.py.
`FlowSolver` steps one modality on its own schedule, keeping what a multistep method needs between steps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from h3serve.rules.names import SAMPLE_SOLVERS


def shift_sigma(base: float | torch.Tensor, shift: float) -> float | torch.Tensor:
    """The released ladder's σ at base position `base` (a float or a tensor): s·b / (1 + (s - 1)·b)."""
    return shift * base / (1 + (shift - 1) * base)


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
            sigmas = torch.unique_consecutive(shift_sigma(base, shift))
        else:
            if len(positions) != steps + 1:
                raise ValueError(f"{len(positions)} pinned positions do not make {steps} forwards")
            base = torch.tensor(positions, dtype=torch.float32)
            sigmas = shift_sigma(base, shift)
            if not bool((sigmas[1:] < sigmas[:-1]).all()):
                raise ValueError(f"pinned positions {positions} collapse under shift {shift} in fp32")
        return cls(sigmas=sigmas, timesteps=1.0 - sigmas[:-1])

    def to(self, device: torch.device) -> FlowSchedule:
        """The same schedule on `device` (once per request: a step then reads it without a host copy)."""
        return FlowSchedule(sigmas=self.sigmas.to(device), timesteps=self.timesteps.to(device))

    def __len__(self) -> int:
        return self.timesteps.numel()

    def denoised(self, velocity: torch.Tensor, index: int, sample: torch.Tensor) -> torch.Tensor:
        """The clean estimate x0 = x + sigma·v at grid point `index`."""
        t = self.timesteps[index].to(sample.device, sample.dtype)
        return sample + (1 - t) * velocity  # sigma taken from t, as the reference does

    def step(self, velocity: torch.Tensor, index: int, sample: torch.Tensor) -> torch.Tensor:
        """One Euler (eta = 0) step from grid point `index` to `index + 1`, blended in fp32."""
        return self.step_from_x0(self.denoised(velocity, index, sample), index, sample)

    def step_from_x0(self, denoised: torch.Tensor, index: int, sample: torch.Tensor) -> torch.Tensor:
        """The same Euler step given the clean estimate; at the last grid point (sigma 0) it returns `denoised`."""
        ratio = (self.sigmas[index + 1] / self.sigmas[index]).to(sample.device, torch.float32)
        out = ratio * sample.float() + (1.0 - ratio) * denoised.float()
        return out.to(sample.dtype)


PHI2_SERIES_BELOW = 1e-5  # below this h, (phi1 - 1) / -h cancels: its Taylor series is exact to float64 instead


def res_multistep_weights(sigmas: torch.Tensor) -> list[tuple[float, float] | None]:
    """Per step i, the weights (w1, w2) of ComfyUI's `res_multistep` at eta 0 (an exponential integrator,
    arXiv 2308.02157), with c = sigma_i, n = sigma_{i+1}, p = sigma_{i-1} and D the clean estimates:

        x_{i+1} = (n/c)·x_i + w1·D_i + w2·D_{i-1},   h = ln(c/n),  c2 = ln(c/p) / h,
        phi1 = expm1(-h) / -h,  phi2 = (phi1 - 1) / -h,  w1 = h·(phi1 - phi2/c2),  w2 = h·phi2/c2.

    None where the step is Euler: the first (no D_{i-1} yet) and one ending at sigma 0 (h is infinite). The
    weights are computed in float64 from the (fp32) sigmas, once per request; the step applies them in fp32.
    w1 + w2 = 1 - n/c, so a constant estimate steps exactly as Euler does."""
    values = [float(s) for s in sigmas.detach().cpu().double()]
    weights: list[tuple[float, float] | None] = []
    for i in range(len(values) - 1):
        c, n = values[i], values[i + 1]
        if i == 0 or n == 0:
            weights.append(None)
            continue
        h = math.log(c / n)
        c2 = math.log(c / values[i - 1]) / h
        phi1 = math.expm1(-h) / -h
        phi2 = (phi1 - 1) / -h if h >= PHI2_SERIES_BELOW else 0.5 - h / 6 + h * h / 24 - h**3 / 120
        weights.append((h * (phi1 - phi2 / c2), h * phi2 / c2))
    return weights


class FlowSolver:
    """One modality's sampler on its own schedule: `euler` (the schedule's own step) or `res_multistep`, which
    keeps the previous clean estimate. One per modality and denoise loop (each continuation window starts afresh);
    steps must come in order. Every tensor a step reads is on the device before the loop."""

    def __init__(self, schedule: FlowSchedule, name: str = "euler", device: torch.device | None = None):
        if name not in SAMPLE_SOLVERS:
            raise ValueError(f"unknown sample solver {name!r}; choose from {', '.join(SAMPLE_SOLVERS)}")
        weights = res_multistep_weights(schedule.sigmas) if name == "res_multistep" else [None] * len(schedule)
        self.name = name
        self.schedule = schedule if device is None else schedule.to(device)
        # Which branch a step takes is known on the host: choosing it never reads a device value.
        self._second_order = tuple(w is not None for w in weights)
        self._weights = torch.tensor(
            [w or (0.0, 0.0) for w in weights], dtype=torch.float32, device=self.schedule.sigmas.device
        )
        self._previous: torch.Tensor | None = None  # D_{i-1}, fp32

    def step(self, velocity: torch.Tensor, index: int, sample: torch.Tensor) -> torch.Tensor:
        """One step from grid point `index` to `index + 1` given the model's velocity."""
        return self.step_from_x0(self.schedule.denoised(velocity, index, sample), index, sample)

    def step_from_x0(self, denoised: torch.Tensor, index: int, sample: torch.Tensor) -> torch.Tensor:
        """One step given the clean estimate D_i. Euler steps are `FlowSchedule.step_from_x0`, bit for bit."""
        if self._second_order[index]:
            if self._previous is None:
                raise RuntimeError(f"res_multistep step {index} needs step {index - 1}'s estimate: steps run in order")
            sigmas, w = self.schedule.sigmas, self._weights[index]
            ratio = (sigmas[index + 1] / sigmas[index]).to(sample.device, torch.float32)
            out = ratio * sample.float() + w[0] * denoised.float() + w[1] * self._previous
            out = out.to(sample.dtype)
        else:
            out = self.schedule.step_from_x0(denoised, index, sample)
        if self.name == "res_multistep" and index + 1 < len(self.schedule):
            # A copy: the caller may reuse the estimate's storage; the next step reads this one.
            self._previous = denoised.to(torch.float32, copy=True)
        return out


def scale_noise(sample: torch.Tensor, t: float, noise: torch.Tensor) -> torch.Tensor:
    """Forward process at face-value t: t·x0 + (1 - t)·noise (used for condition anchors at t = 0.999)."""
    tt = torch.tensor(t, dtype=sample.dtype, device=sample.device)
    return tt * sample + (1.0 - tt) * noise
