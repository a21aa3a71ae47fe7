"""Step counts and pinned schedules, as planning sees them (no torch: the API process runs this).

`num_inference_steps` = N counts **denoiser forwards**, as vLLM-Omni 0.30 does: the grid holds N + 1 sigma points,
`linspace(1, 0, N + 1)` shifted per modality by sigma = s·u / (1 + (s - 1)·u). That is the diffusers 0.42.1
MiniMaxH3Scheduler at `num_inference_steps = N + 1` (it counts grid points); the torch grid itself is built in
`h3serve.model.scheduler.FlowSchedule`, bit for bit the reference's.

A checkpoint or an adapter may pin its own schedule (`PinnedSchedule`): sigma *positions* u before the shift
(FastH3: 0.999, 0.749, 0.5, 0.25, 0), or only a step count on the uniform grid (a Turbo LoRA), and optionally the
shifts. A request may then omit `num_inference_steps` (and a pinned shift) or restate the pinned value; anything
else is a `RequestError` naming the owner and its step count. Use it one of two ways:

- a checkpoint-wide pin (an adapter fused at load): `ModelDefaults(pinned_schedule=PinnedSchedule(...))`;
- a per-request adapter: `validate(request, dataclasses.replace(defaults, pinned_schedule=adapter_pin))`.

The plan then carries `steps` = the pin's count and `pinned_positions` = its positions (None: uniform grid).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from h3serve.errors import RequestError
from h3serve.rules import limits
from h3serve.rules.shown import shown

FIELD = "steps"  # the request field (the API names it num_inference_steps)


@dataclass(frozen=True)
class PinnedSchedule:
    """A schedule a checkpoint or an adapter fixes. `owner` names it in errors, e.g. "adapter 'fasth3'".

    `positions`: sigma positions before the shift, strictly decreasing, first in (0, 1], last exactly 0; its
    length is steps + 1. None: the uniform grid of `steps` forwards (then `steps` is required). `flow_shift` /
    `audio_flow_shift`: pinned shifts (None: the request or the checkpoint decides)."""

    owner: str
    positions: tuple[float, ...] | None = None
    steps: int | None = None
    flow_shift: float | None = None
    audio_flow_shift: float | None = None

    def __post_init__(self) -> None:
        if self.positions is None:
            if isinstance(self.steps, bool) or not isinstance(self.steps, int) or self.steps < 1:
                raise ValueError(f"{self.owner}: a uniform pinned schedule needs steps >= 1, got {self.steps!r}")
        else:
            object.__setattr__(self, "positions", check_positions(self.positions, self.owner))
            count = len(self.positions) - 1
            if self.steps is not None and self.steps != count:
                raise ValueError(f"{self.owner}: steps={self.steps} but {len(self.positions)} positions "
                                 f"({count} forwards)")
            object.__setattr__(self, "steps", count)
        for name in ("flow_shift", "audio_flow_shift"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and 0 < value <= limits.MAX_FLOW_SHIFT):
                raise ValueError(f"{self.owner}: {name} must be in (0, {limits.MAX_FLOW_SHIFT:g}], got {value!r}")

    @property
    def forwards(self) -> int:
        """The pinned number of denoiser forwards (= len(positions) - 1)."""
        assert self.steps is not None  # set in __post_init__
        return self.steps


def check_positions(positions: tuple[float, ...] | list[float], owner: str = "schedule") -> tuple[float, ...]:
    """Positions as a float tuple, or ValueError: at least 2, strictly decreasing, first in (0, 1], last 0."""
    values = tuple(float(p) for p in positions)
    if len(values) < 2:
        raise ValueError(f"{owner}: a pinned schedule needs at least 2 positions (1 forward), got {len(values)}")
    if not all(math.isfinite(p) for p in values) or not 0 < values[0] <= 1 or values[-1] != 0:
        raise ValueError(f"{owner}: positions must start in (0, 1] and end at 0, got {values}")
    if any(b >= a for a, b in zip(values, values[1:], strict=False)):
        raise ValueError(f"{owner}: positions must be strictly decreasing, got {values}")
    return values


def resolve_steps(requested: object, pin: PinnedSchedule | None, default: int = limits.DEFAULT_STEPS) -> int:
    """The forward count N a request runs. Without a pin: `requested` (an int in MIN_STEPS..MAX_STEPS) or
    `default`. With a pin: the pin's count, which `requested` must equal if given."""
    if requested is not None and (isinstance(requested, bool) or not isinstance(requested, int)):
        raise RequestError(FIELD, f"must be an integer, got {shown(requested)}")
    if pin is not None:
        if requested is not None and requested != pin.forwards:
            raise RequestError(FIELD, f"{pin.owner} runs exactly {pin.forwards} steps (denoiser forwards); "
                                       f"omit the field or send {pin.forwards}, got {shown(requested)}")
        return pin.forwards
    if requested is None:
        return default
    if not limits.MIN_STEPS <= requested <= limits.MAX_STEPS:
        raise RequestError(FIELD, f"must be between {limits.MIN_STEPS} and {limits.MAX_STEPS}, got {shown(requested)}")
    return requested


def resolve_pinned_shift(field: str, requested: float | None, pin: PinnedSchedule | None) -> float | None:
    """A pinned shift, which the request must omit or restate exactly; None when not pinned (the caller's rule
    applies to `requested`)."""
    pinned = None if pin is None else getattr(pin, field)
    if pin is None or pinned is None:
        return None
    if requested is not None and not (isinstance(requested, int | float) and float(requested) == pinned):
        raise RequestError(field, f"{pin.owner} runs at {field} {pinned:g} ({pin.forwards} steps); omit the "
                                   f"field or send {pinned:g}, got {shown(requested)}")
    return float(pinned)


def uniform_positions(steps: int) -> tuple[float, ...]:
    """linspace(1, 0, steps + 1) in Python floats: the documented grid (the sampler builds it in fp32 torch)."""
    return tuple(1.0 - i / steps for i in range(steps)) + (0.0,)


def shift_sigma(position: float, shift: float) -> float:
    """sigma = s·u / (1 + (s - 1)·u): the per-modality flow shift of one position u."""
    return shift * position / (1 + (shift - 1) * position)


def shifted_sigmas(positions: tuple[float, ...], shift: float) -> tuple[float, ...]:
    """Every position through `shift_sigma` (float64; for plans, reports and tests)."""
    return tuple(shift_sigma(p, shift) for p in positions)
