"""`h3serve train-demo` (the shipped demo checkpoint, from scratch) and `h3serve check-demo` (does an MP4 show and
sound what its demo-world prompt asks for?)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from h3serve.tools.cli_util import EXIT_ERROR, fail


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train-demo", help="train the demo checkpoint (a tiny H3 on the demo world) from scratch")
    p.add_argument("--out", required=True, help="output folder (absent or empty): the checkpoint, losses.png")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--scale", type=float, default=1.0, help="multiply every step and example count (e.g. 0.01 for a smoke run)"
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_train_demo)

    p = sub.add_parser("check-demo", help="measure a demo-world MP4: colour, motion, pitch, pan, bounces and clicks")
    p.add_argument("video", help="an MP4 made from a demo-world prompt")
    p.add_argument("--prompt", required=True, help="the prompt it was made from (the README's grammar)")
    p.add_argument("--json", action="store_true", help="print the checks as JSON")
    p.set_defaults(func=cmd_check_demo)


def cmd_train_demo(args: argparse.Namespace) -> int:
    from h3serve.tools.demo_training.train import LOSS_PLOT, Recipe, train_demo

    if not args.scale > 0:
        return fail(f"--scale: must be positive, got {args.scale}")
    if args.seed < 0:
        return fail(f"--seed: must be >= 0, got {args.seed}")
    recipe = Recipe(seed=args.seed).scaled(args.scale)
    try:
        out = train_demo(args.out, recipe, progress=not args.no_progress)
    except FileExistsError as e:
        return fail(str(e))
    print(f"wrote {out} (loss plot: {out / LOSS_PLOT})")
    return 0


def mp4_verdict(path: str | Path, prompt: str):
    """The demo-world checks of `prompt` on an MP4 as a user decodes it (`ValueError` for a prompt outside the
    grammar): what `check-demo` prints and the selftest's end-to-end check on the demo checkpoint asserts."""
    from h3serve.media.mp4 import rgb8
    from h3serve.tools.compare import decode_mp4
    from h3serve.tools.demo_world.checks import verdict_t2va
    from h3serve.tools.demo_world.grammar import parse_prompt

    attrs = parse_prompt(prompt)
    clip = decode_mp4(path)
    return verdict_t2va(rgb8(clip.video), clip.audio, attrs)


def cmd_check_demo(args: argparse.Namespace) -> int:
    from h3serve.tools.demo_world.grammar import parse_prompt

    try:
        parse_prompt(args.prompt)
    except ValueError as e:
        return fail(f"--prompt: {e}")
    if not Path(args.video).is_file():
        return fail(f"video: no such file {args.video}")
    verdict = mp4_verdict(args.video, args.prompt)
    if args.json:
        print(json.dumps({"passed": verdict.passed, "checks": verdict.checks}))
    else:
        for name, ok in verdict.checks.items():
            print(f"{'ok  ' if ok else 'FAIL'} {name}")
        print("all checks passed" if verdict.passed else f"failed: {', '.join(verdict.failed)}")
    return 0 if verdict.passed else EXIT_ERROR
