"""`h3serve train-demo` (the shipped demo checkpoint, from scratch), `h3serve check-demo` (does an MP4 show and
sound what its demo-world prompt asks for?) and `h3serve eval-demo` (every task over seeds: docs/demo_world.md's
tables)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from h3serve.entrypoints.cli_util import EXIT_ERROR, fail, model_dir

MAX_EVAL_SEEDS = 1000


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

    p = sub.add_parser(
        "eval-demo", help="run demo-world tasks over seeds on a checkpoint and count the cases right in every check"
    )
    p.add_argument("--model", help="checkpoint folder (default: the shipped demo checkpoint)")
    p.add_argument("--tasks", help="comma-separated tasks (default: all; a wrong one lists them)")
    p.add_argument("--seeds", type=int, default=10, help=f"seeds 0..N-1 for each task (1-{MAX_EVAL_SEEDS})")
    p.add_argument("--steps", type=int, help="denoiser steps (default: the demo's)")
    p.add_argument("--quantization", help="fp8: FP8 weights, as `generate --quantization fp8`")
    p.add_argument("--json", dest="json_out", help="also write the scores to this JSON file")
    p.set_defaults(func=cmd_eval_demo)


def cmd_train_demo(args: argparse.Namespace) -> int:
    from h3serve.demo.training.train import LOSS_PLOT, Recipe, train_demo

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
    from h3serve.demo.world.checks import verdict_t2va
    from h3serve.demo.world.grammar import parse_prompt
    from h3serve.media.mp4 import rgb8
    from h3serve.tools.clip_compare import decode_mp4

    attrs = parse_prompt(prompt)
    clip = decode_mp4(path)
    return verdict_t2va(rgb8(clip.video), clip.audio, attrs)


def cmd_check_demo(args: argparse.Namespace) -> int:
    from h3serve.demo.world.grammar import parse_prompt

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


def cmd_eval_demo(args: argparse.Namespace) -> int:
    from h3serve.accel.quant_config import QuantizationError, parse_quantization
    from h3serve.demo.defaults import DEMO_STEPS
    from h3serve.demo.evaluation import TASKS, DemoEvaluator, evaluate, summarize
    from h3serve.errors import RequestError
    from h3serve.rules.schedule import resolve_steps

    tasks = args.tasks.split(",") if args.tasks else list(TASKS)
    if unknown := [task for task in tasks if task not in TASKS]:
        return fail(f"--tasks: unknown {', '.join(unknown)}; choose from: {', '.join(TASKS)}")
    if not 1 <= args.seeds <= MAX_EVAL_SEEDS:
        return fail(f"--seeds: must be 1-{MAX_EVAL_SEEDS}, got {args.seeds}")
    try:
        steps = resolve_steps(args.steps, None, DEMO_STEPS)  # a request's bounds
    except RequestError as e:
        return fail(f"--{e}")
    try:
        quantization = parse_quantization(args.quantization, None)
    except QuantizationError as e:
        return fail(str(e))
    model = model_dir(args.model)
    if not model.is_dir():
        return fail(f"--model: no such folder {model}")
    evaluator = DemoEvaluator.load(model, quantization, steps)
    scores = {}
    for task in tasks:
        scores[task] = score = summarize(evaluate(evaluator, task, range(args.seeds)))
        wrong = ", ".join(f"{name} {count}" for name, count in score["wrong"].items()) or "none"
        print(f"{task}: {score['right']} of {score['cases']} right; wrong: {wrong}", flush=True)
    if args.json_out:
        record = {"model": str(model), "steps": steps, "quantization": args.quantization, "tasks": scores}
        Path(args.json_out).write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    return 0
