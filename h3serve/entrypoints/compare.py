"""`h3serve compare A B`: fidelity of one output against another (h3serve.tools.clip_compare measures it)."""

from __future__ import annotations

import argparse
import json
import sys

from h3serve.tools.clip_compare import THRESHOLDS, compare_clips, format_comparison, load_clip, threshold_failures

EXIT_USAGE = 2
EXIT_BELOW_THRESHOLD = 1


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("compare", help="fidelity of B against A: PSNR, SSIM, pixel and log-mel cosine, SNR")
    p.add_argument("a", help="reference: .mp4, or .npz from --save-raw")
    p.add_argument("b", help="the output to judge: .mp4 or .npz")
    p.add_argument("--json", action="store_true", help="print one JSON object (infinite values as null)")
    for flag, (field, at_least) in THRESHOLDS.items():
        kind = "lowest" if at_least else "highest"
        p.add_argument(f"--{flag.replace('_', '-')}", type=float, help=f"exit 1 unless {field} is at {kind} this")
    p.add_argument("--same-length", action="store_true", help="exit 1 unless frame and sample counts are equal")
    p.set_defaults(func=cmd_compare)


def cmd_compare(args: argparse.Namespace) -> int:
    try:
        result = compare_clips(load_clip(args.a), load_clip(args.b))
    except (OSError, ValueError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    print(json.dumps(result.to_json(), indent=2) if args.json else format_comparison(result))
    failures = threshold_failures(result, {k: getattr(args, k) for k in THRESHOLDS}, args.same_length)
    for line in failures:
        print(f"below threshold: {line}", file=sys.stderr)
    return EXIT_BELOW_THRESHOLD if failures else 0
