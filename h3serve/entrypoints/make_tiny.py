"""`h3serve make-tiny-checkpoint` and `make-tiny-adapter`: deterministic small files in the released layouts."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from h3serve.entrypoints.cli_util import fail


def register_checkpoint(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("make-tiny-checkpoint", help="build a deterministic random-weight H3 checkpoint")
    p.add_argument("dir", nargs="?", help="output folder (omit with --default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--preset", default="tiny", help="tiny | cpu-bench")
    p.add_argument("--default", action="store_true", help="build (if missing) the cached default and print its path")
    p.add_argument(
        "--layout",
        default="modular",
        help="modular (diffusers modular_model_index.json) | native (the MiniMaxAI FL2VA/ + Ref2VA/ folders) | "
        "fasth3-v2 (FastVideo's FastH3 8-step V2 tree; its base, for --base-checkpoint, is the modular checkpoint of "
        "the same preset and seed, printed on stderr)",
    )
    p.set_defaults(func=cmd_make_tiny)


def cmd_make_tiny(args: argparse.Namespace) -> int:
    from h3serve.tools.tiny.make_checkpoint import PRESETS, build_tiny_checkpoint, ensure_tiny_checkpoint

    if args.preset not in PRESETS:
        return fail(f"--preset: unknown preset {args.preset!r}; choose from: {', '.join(PRESETS)}")
    if args.default == bool(args.dir):
        return fail("give either DIR or --default")
    if args.layout not in ("modular", "native", "fasth3-v2"):
        return fail(f"--layout: unknown layout {args.layout!r}; choose from: modular, native, fasth3-v2")
    if args.layout == "fasth3-v2":
        from h3serve.tools.tiny.make_checkpoint import default_checkpoint_dir
        from h3serve.tools.tiny.make_fasth3_v2 import v2_from_modular

        base = ensure_tiny_checkpoint(preset=args.preset, seed=args.seed)
        target = Path(args.dir) if args.dir else default_checkpoint_dir(args.preset, args.seed).with_name(
            f"{args.preset}-seed{args.seed}-fasth3-v2")
        if not (args.default and (target / "fastvideo_inference.json").is_file()):
            v2_from_modular(base, target, seed=args.seed)
        print(f"base checkpoint (--base-checkpoint): {base}", file=sys.stderr)
        print(target)
        return 0
    if args.layout == "native":
        from h3serve.tools.tiny.make_native import build_native_checkpoint, ensure_native_checkpoint

        build = ensure_native_checkpoint if args.default else build_native_checkpoint
        print(build(*([] if args.default else [args.dir]), seed=args.seed, preset=args.preset))
        return 0
    if args.default:
        path = ensure_tiny_checkpoint(preset=args.preset, seed=args.seed)
    else:
        path = build_tiny_checkpoint(args.dir, seed=args.seed, preset=args.preset)
    print(path)
    return 0


def register_adapter(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("make-tiny-adapter", help="write a deterministic synthetic DiT adapter for a tiny preset")
    p.add_argument("dir", help="output folder (created)")
    p.add_argument("--format", required=True,
                   help="peft (per-request LoRA) | turbo (LightX2V 4-step) | fasth3 | pdd (PAI 8-step, FL2VA) | "
                   "controlnet | taomate (TaoMate-H3 real-time LoRA directory: --realtime-lora) | flashgen "
                   "(FlashGen's native 4-step T2VA LoRA)")
    p.add_argument("--preset", default="tiny", help="tiny | cpu-bench (the checkpoint preset it adapts)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rank", type=int,
                   help="low-rank size (default: peft 4, turbo 8, fasth3 4, taomate 4, flashgen 4)")
    p.set_defaults(func=cmd_make_adapter)


def cmd_make_adapter(args: argparse.Namespace) -> int:
    from h3serve.tools.tiny.make_adapter import make_tiny_adapter

    try:
        path = make_tiny_adapter(args.dir, args.format, args.preset, args.seed, args.rank)
    except ValueError as e:
        return fail(str(e))
    print(path)
    return 0
