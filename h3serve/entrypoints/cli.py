"""The `h3serve` command: one subcommand per module of this room (generate, serve, plan, ...) and the tools'."""

from __future__ import annotations

import argparse
import sys

from h3serve.entrypoints import (
    bench,
    compare,
    demo_commands,
    generate,
    make_tiny,
    plan,
    probe,
    selftest,
    serve,
    webhooks,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="h3serve", description="Serve and run MiniMax-H3 (video + audio).")
    sub = parser.add_subparsers(dest="command", required=True)
    generate.register(sub)
    make_tiny.register_checkpoint(sub)
    make_tiny.register_adapter(sub)
    serve.register(sub)
    compare.register(sub)
    probe.register(sub)
    bench.register(sub)
    plan.register(sub)
    selftest.register(sub)
    demo_commands.register(sub)
    webhooks.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
