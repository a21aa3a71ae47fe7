"""`h3serve probe OUT.mp4`: check a file against the output contract (a wrapper on `h3serve.media.output_probe`)."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict

EXIT_VIOLATION = 1


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "probe", help="check an MP4 against the output contract (H.264 24 fps, AAC 32 kHz stereo, 17n+5 frames)"
    )
    p.add_argument("path", help="the .mp4 to check")
    p.add_argument("--json", action="store_true", help="print the probed fields and the violations as JSON")
    p.set_defaults(func=cmd_probe)


def cmd_probe(args: argparse.Namespace) -> int:
    """Exit 0 when the file meets the contract, 1 with one line per violation otherwise.

    Read with ffprobe/ffmpeg when installed, else with PyAV; the summary line (and ``reader`` in --json) says
    which."""
    from h3serve.media.output_probe import check_output_contract, probe, summary_line

    result = probe(args.path)  # never raises for a bad file: the violations say what is wrong
    problems = check_output_contract(result)
    if args.json:
        print(json.dumps({**asdict(result), "violations": problems}, indent=2))
    else:
        print(summary_line(result))
    for problem in problems:
        print(f"contract violated: {problem}", file=sys.stderr)
    return EXIT_VIOLATION if problems else 0
