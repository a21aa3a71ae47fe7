"""The memory planner's verdict for the released model on this GPU (the `h3serve plan` computation)."""

from __future__ import annotations

import torch


def released_verdict(device: torch.device) -> tuple[str, dict]:
    """The planner's "fits" / "does not fit" for the released H3 (default flags) at 1344x768, 5 s on one GPU of this
    size, with its peak."""
    import argparse

    from h3serve.tools import plan_cli

    memory = torch.cuda.get_device_properties(device).total_memory
    parser = argparse.ArgumentParser(prog="h3serve")
    plan_cli.register(parser.add_subparsers())
    args = parser.parse_args(
        ["plan", "--preset", "released", "--width", "1344", "--height", "768", "--device-memory", str(memory)]
    )
    plan, _ = plan_cli.build_plan(args)
    peak = plan.peak_device_bytes
    word = "fits" if plan.fits else f"does not fit ({plan.shortfall_bytes / 2**30:.1f} GiB short; see h3serve plan)"
    figure = f"released H3, default flags, one GPU of this size: {word}, peak {peak / 2**30:.1f} GiB"
    return figure, {"peak": peak, "fits": plan.fits}
