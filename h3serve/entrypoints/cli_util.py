"""Helpers every `h3serve` subcommand shares; no imports of the subcommands, so any of them may use these."""

from __future__ import annotations

import sys
from pathlib import Path

EXIT_ERROR = 1  # the command could not run (an engine, a data dir)
EXIT_USAGE = 2  # a bad flag or configuration


def fail(message: str, code: int = EXIT_USAGE) -> int:
    """Print `error: message` on stderr; returns the exit code (2 for a usage or configuration error)."""
    print(f"error: {message}", file=sys.stderr)
    return code


def model_dir(arg: str | None) -> Path:
    """The checkpoint to use: the given folder, else the trained demo checkpoint shipped with h3serve, else (where
    an install left it out) the random tiny checkpoint, built on first use."""
    if arg:
        return Path(arg).expanduser()
    from h3serve.demo.shipped import shipped_demo_checkpoint

    if (demo := shipped_demo_checkpoint()) is not None:
        return demo
    from h3serve.tools.tiny.make_checkpoint import ensure_tiny_checkpoint

    return ensure_tiny_checkpoint()
