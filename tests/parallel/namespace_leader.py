"""Node 0 of tests/parallel/test_two_namespaces.py: the leader's engine as `h3serve serve` starts it, an Executor
on the rendezvous that NNODES, NODE_RANK, MASTER_ADDR and MASTER_PORT describe, with the serve flags given here.

It runs the requests `--steps` lists one after the other (the test kills parts of node 1 during some) and reports
to the test in JSON lines on stdout: {"request": I, "step": N} as request I runs, then {"request": I, "output":
FILE} (its arrays, h3serve.media.raw) or {"request": I, "failed": MESSAGE}; {"closed": true} once the engine is
closed.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rank_plans import plan_for

from h3serve.engine.executor import EngineError, Executor
from h3serve.entrypoints.engine_args import add_engine_args, engine_config_from_args
from h3serve.media.raw import write_raw


def say(**message) -> None:
    print(json.dumps(message), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model", type=Path)
    parser.add_argument("--out", type=Path, required=True, help="folder for each request's arrays")
    parser.add_argument("--steps", required=True, help="each request's steps, comma-separated")
    add_engine_args(parser)
    args = parser.parse_args()
    executor = Executor(engine_config_from_args(args, args.model))
    try:
        for index, steps in enumerate(int(text) for text in args.steps.split(",")):
            try:
                output = executor.generate(plan_for(executor.defaults, steps=steps),
                                           on_progress=lambda done, total, i=index: say(request=i, step=done))
            except EngineError as e:
                say(request=index, failed=str(e))
                continue
            path = args.out / f"request{index}.npz"
            write_raw(path, output.video, output.audio)
            say(request=index, output=str(path))
    finally:
        executor.close()
    say(closed=True)


if __name__ == "__main__":  # the ranks start by spawn or a fork server: they must not run this again
    main()
