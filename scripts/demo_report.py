"""The measured table of docs/demo_world.md: every task of the demo checkpoint over 10 seeds, right or wrong per check.

    python scripts/demo_report.py --model DIR [--seeds 10] > table.md

Runs on the CPU in the process (fp32), the same cases as tests/demo/test_shipped_checkpoint.py
(h3serve.demo.evaluation).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from h3serve.config.quantization_config import parse_quantization
from h3serve.demo.evaluation import TASKS, DemoEvaluator, evaluate, summarize
from h3serve.demo.shipped import DEMO_STEPS


def rows(label: str, evaluator: DemoEvaluator, tasks: tuple[str, ...], seeds: range) -> list[str]:
    out = []
    for task in tasks:
        started = time.perf_counter()
        cases = evaluate(evaluator, task, seeds)
        seconds = (time.perf_counter() - started) / len(cases)
        score = summarize(cases)
        misses = ", ".join(f"{name} ×{count}" for name, count in sorted(score["wrong"].items())) or "none"
        out.append(f"| {task} | {label} | **{score['right']} / {score['cases']}** | {misses} | {seconds:.1f} s |")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True, help="a checkpoint written by `h3serve train-demo`")
    parser.add_argument("--seeds", type=int, default=10)
    args = parser.parse_args()
    seeds = range(args.seeds)
    base = DemoEvaluator.load(args.model)
    fp8 = DemoEvaluator.load(args.model, parse_quantization("fp8", None))
    lines = ["| task | run | right (all checks) | failed checks | per case |", "|---|---|---|---|---|"]
    lines += rows(f"fp32, {DEMO_STEPS} steps", base, TASKS, seeds)
    lines += rows("fp32, 4 steps", DemoEvaluator(base.pipeline, base.defaults, steps=4), ("t2va",), seeds)
    lines += rows(f"FP8 weights, {DEMO_STEPS} steps", fp8, ("t2va",), seeds)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
