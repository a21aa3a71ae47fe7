"""Admission by cost: a stated model of what a request costs the engine, checked before it is queued.

cost = width × height × frames × steps × outputs / 10^6 ("Mpx·frame·steps"), steps counting denoiser forwards (N,
not the N + 1 sigma points), outputs the request's num_outputs_per_prompt (a job of N outputs costs N single ones).
Denoising dominates a job and each step is at least linear in the latent tokens (pixels × frames), so this orders
requests by run time and memory; it is conservative for attention, which grows faster. The default limit is what the
checkpoint's own largest canvas costs at the longest duration with twice the default steps: any request the model
card calls ordinary passes, and a 4096×4096, 15 s, 200-step request (~33x the limit) is refused before it can hold
the engine. The longest duration is that of the request's mode (15 s, 30 s with `long_video_mode=full`, 300 s by
continuation), so a long video the model card offers passes by default too; `--max-request-cost` sets one limit for
every mode.
"""

from __future__ import annotations

from h3serve.errors import ClientError
from h3serve.rules import geometry, limits
from h3serve.rules.long_video import max_duration_s
from h3serve.rules.validate import GenerationPlan, ModelDefaults

COST_UNIT = 1e6
DEFAULT_STEPS_FACTOR = 2  # the default limit allows twice the default number of steps at the largest canvas


class TooCostly(ClientError, ValueError):
    """The request's cost is over the limit; the message names both and the formula."""

    code = "request_too_costly"


def request_cost(plan: GenerationPlan) -> float:
    return plan.width * plan.height * plan.num_frames * plan.steps * plan.num_outputs / COST_UNIT


def default_max_cost(defaults: ModelDefaults, long_video_mode: str | None = None) -> float:
    """The default limit for a request of `long_video_mode` (None: an ordinary request)."""
    frames = geometry.frames_for_duration(max_duration_s(long_video_mode))
    return defaults.canvas_max_pixels * frames * limits.DEFAULT_STEPS * DEFAULT_STEPS_FACTOR / COST_UNIT


def check_cost(plan: GenerationPlan, max_cost: float) -> None:
    cost = request_cost(plan)
    if cost > max_cost:
        outputs = f" x {plan.num_outputs} outputs" if plan.num_outputs > 1 else ""
        raise TooCostly(
            f"this request costs {cost:,.0f} (width {plan.width} x height {plan.height} x {plan.num_frames} frames "
            f"x {plan.steps} steps{outputs} / 1e6), over this server's limit of {max_cost:,.0f} "
            "(--max-request-cost); use a smaller size, a shorter duration, fewer steps or fewer outputs"
        )
