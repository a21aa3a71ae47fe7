"""The memory planner's verdict for the released model on this GPU (the `h3serve plan` computation)."""

from __future__ import annotations

import torch


def released_verdict(device: torch.device) -> tuple[str, dict]:
    """"fits" / "does not fit" for the released H3 at 1344x768, 5 s on one GPU of this size, with the peak."""
    from h3serve.cli import build_parser
    from h3serve.tools.plan_cli import build_plan

    memory = torch.cuda.get_device_properties(device).total_memory
    args = build_parser().parse_args(
        ["plan", "--preset", "released", "--width", "1344", "--height", "768", "--device-memory", str(memory)]
    )
    plan, _ = build_plan(args)
    peak = plan.peak_device_bytes
    word = "fits" if plan.fits else f"does not fit ({plan.shortfall_bytes / 2**30:.1f} GiB short; see h3serve plan)"
    return f"released H3 on one GPU {word}, peak {peak / 2**30:.1f} GiB", {"peak": peak, "fits": plan.fits}
