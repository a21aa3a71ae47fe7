"""`h3serve train-demo` (the shipped demo checkpoint, from scratch), `h3serve check-demo` (does an MP4 show and
sound what its demo-world prompt asks for?) and `h3serve eval-demo` (every task over seeds: docs/demo_world.md's
tables)."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from h3serve.entrypoints.cli_util import EXIT_ERROR, fail, model_dir

MAX_EVAL_SEEDS = 1000
EXIT_STOPPED = 3  # train-demo stopped before its last stage: `--resume DIR` goes on


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train-demo",
        help="train the demo checkpoint (a tiny H3 on the demo world) from scratch, in resumable stages",
        description="Train the demo checkpoint in stages of at most ~50 minutes on 2 CPU cores, each ending in a "
        "checkpoint of everything the next needs: --out DIR starts, --resume DIR goes on (the result equals an "
        "uninterrupted run's bit for bit on one machine), --plan prints the stages and their estimated minutes. "
        f"Exit status {EXIT_STOPPED}: stopped before the end (budget spent, SIGINT or SIGTERM); resume it.",
    )
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--out", help="a new training's folder (absent or empty): the checkpoint when done")
    where.add_argument("--resume", metavar="DIR", help="go on with the training in DIR")
    where.add_argument("--plan", action="store_true", help="print the recipe's stages and estimated minutes")
    p.add_argument("--recipe", help="a named recipe (default: the newest; run15 made the shipped weights)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--scale", type=float, default=1.0, help="multiply every step and example count (e.g. 0.01 for a smoke run)"
    )
    p.add_argument("--device", choices=("cpu", "cuda"), help="where the VAEs and DiTs train (default: cpu; on "
                   "--resume, the device the training last ran on)")
    p.add_argument("--budget-minutes", type=float, help="stop cleanly once this session has run this long "
                   "(at the next DiT step or stage boundary)")
    p.add_argument("--measure", action="store_true", help="with --plan: measure each kind of DiT step here first")
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
    from h3serve.demo.training.train import DEFAULT_RECIPE, RECIPES

    if args.resume is not None and (args.recipe or args.seed or args.scale != 1.0):
        return fail("--resume: the training's own recipe goes on; --recipe, --seed and --scale are for a new one")
    name = args.recipe or DEFAULT_RECIPE
    if name not in RECIPES:
        return fail(f"--recipe: unknown {name!r}; choose from: {', '.join(RECIPES)}")
    if not args.scale > 0:
        return fail(f"--scale: must be positive, got {args.scale}")
    if args.seed < 0:
        return fail(f"--seed: must be >= 0, got {args.seed}")
    if args.budget_minutes is not None and not args.budget_minutes > 0:
        return fail(f"--budget-minutes: must be positive, got {args.budget_minutes}")
    if args.measure and not args.plan:
        return fail("--measure: only with --plan")
    recipe = dataclasses.replace(RECIPES[name], seed=args.seed)
    if args.scale != 1.0:
        recipe, name = recipe.scaled(args.scale), f"{name} scaled {args.scale:g}"
    if args.plan:
        return _print_plan(recipe, name, args.device or "cpu", args.measure)
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        return fail("--device cuda: no CUDA device is visible to torch")
    return _train(args, recipe, name)


def _print_plan(recipe, name: str, device: str, measure: bool) -> int:
    from h3serve.demo.training.estimate import COSTS, format_plan, measured_costs

    costs = measured_costs(recipe) if measure else COSTS[device]
    print(format_plan(recipe, costs, name))
    return 0


def _train(args: argparse.Namespace, recipe, name: str) -> int:
    from h3serve.demo.training.stages import DemoTraining, StopSignal

    try:
        if args.resume is not None:
            training = DemoTraining.resume(args.resume, args.device, progress=not args.no_progress)
        else:
            training = DemoTraining.start(args.out, recipe, args.device or "cpu", not args.no_progress, name)
    except (FileExistsError, FileNotFoundError) as e:
        return fail(str(e))
    with StopSignal(args.budget_minutes) as stop:
        finished = training.run(stop)
    if finished:
        print(f"wrote {training.out} (loss plot: {training.out / 'losses.png'}; recipe and minutes: training.json)")
        return 0
    print(f"stopped before stage {training.remaining[0].label} ({stop.reason}); go on with: "
          f"h3serve train-demo --resume {training.out}")
    return EXIT_STOPPED


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
    from h3serve.config.quantization_config import QuantizationError, parse_quantization
    from h3serve.demo.evaluation import TASKS, DemoEvaluator, evaluate, summarize
    from h3serve.demo.shipped import DEMO_STEPS
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
