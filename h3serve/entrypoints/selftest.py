"""`h3serve selftest`: does this install work on these devices, with these flags (h3serve.tools.selftest has the
checks). This command resolves what the checks are given: the checkpoint, the engine config, the planner's view of
the released model under the same flags, and on the shipped demo checkpoint the demo's request and its verdict."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from h3serve.entrypoints.cli_util import model_dir
from h3serve.entrypoints.engine_args import add_engine_args, engine_config_from_args
from h3serve.errors import ConfigError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("selftest", help="check this install on its devices: numerics, memory paths, speed, one MP4")
    p.add_argument("--model", help="checkpoint for the end-to-end request (default: the shipped demo checkpoint, "
                   "whose MP4 must show what the demo prompt asks)")
    p.add_argument("--budget-s", type=float, default=300.0, help="seconds for all checks (default 300)")
    p.add_argument("--json", metavar="OUT", help="also write the outcomes as JSON to OUT")
    p.add_argument("--only", action="append", default=[], metavar="PREFIX",
                   help="run only the checks whose name starts with PREFIX (repeatable)")
    add_engine_args(p)
    p.set_defaults(func=cmd_selftest)


def cmd_selftest(args: argparse.Namespace) -> int:
    from h3serve.rank.device_checks import check_engine
    from h3serve.tools.selftest.core import FAIL, SelftestContext, table
    from h3serve.tools.selftest.run_checks import run

    try:
        model = model_dir(args.model)  # the shipped demo checkpoint by default: end_to_end checks what it shows
        config = engine_config_from_args(args, model)
        setup = check_engine(config)
        ctx = SelftestContext(
            device=setup.device, dtype=setup.dtype, attention=setup.attention,
            compile=not config.enforce_eager, model=model, engine_config=config, budget_s=args.budget_s,
            released_plan=lambda memory: released_plan(args, memory), demo=demo_request(model),
        )
        outcomes = run(ctx, args.only)
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(table(outcomes))
    if args.json:
        Path(args.json).write_text(json.dumps([o.to_json() for o in outcomes], indent=2, default=str))
    return 1 if any(o.status == FAIL for o in outcomes) else 0


def released_plan(engine_args: argparse.Namespace | None, device_memory: int):
    """The plan `h3serve plan --preset released --width 1344 --height 768` makes under another command's engine
    flags (the selftest's: parallel layout, offload, quantization) for GPUs of `device_memory` bytes."""
    from h3serve.entrypoints.plan import build_plan, plan_parser

    args = plan_parser().parse_args(["plan", "--preset", "released", "--width", "1344", "--height", "768"])
    if engine_args is not None:  # the same engine flags the selftest was given
        for key, value in vars(engine_args).items():
            if hasattr(args, key) and key not in ("func", "model", "json"):
                setattr(args, key, value)
    args.device_memory, args.preset, args.model_dir = str(device_memory), "released", None
    return build_plan(args)[0]


def demo_request(model: Path):
    """On the shipped demo checkpoint, the demo's request and the check of what its MP4 must show; else None."""
    from h3serve.demo.shipped import DEMO_DURATION_S, DEMO_PROMPT, DEMO_STEPS, shipped_demo_checkpoint
    from h3serve.entrypoints.demo_commands import mp4_verdict
    from h3serve.rules.request import GenerationRequest
    from h3serve.tools.selftest.core import DemoRequest
    from h3serve.tools.verdicts import CheckFailed

    demo = shipped_demo_checkpoint()
    if demo is None or Path(model).resolve() != demo.resolve():
        return None

    def verdict(path: Path) -> str:
        got = mp4_verdict(path, DEMO_PROMPT)
        if not got.passed:
            raise CheckFailed(f"the demo checkpoint's MP4 does not show what {DEMO_PROMPT!r} asks: "
                              f"{', '.join(got.failed)} wrong (h3serve check-demo measures it)")
        return f"shows {DEMO_PROMPT!r} ({', '.join(got.checks)} right)"

    return DemoRequest(GenerationRequest(prompt=DEMO_PROMPT, duration_s=DEMO_DURATION_S, steps=DEMO_STEPS, seed=0),
                       verdict)
