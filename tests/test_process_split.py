"""The process boundary: the parent side (API process, job manager, CLI parsing) never imports torch."""

from __future__ import annotations

import pkgutil
import subprocess
import sys

import h3serve.api
import h3serve.engine
import h3serve.jobstore
import h3serve.output_store

LEAVES = ["h3serve.config.engine_config", "h3serve.config_checks", "h3serve.errors", "h3serve.checkpoint.resolver",
          "h3serve.rules.request", "h3serve.rules.validate", "h3serve.rules.limits", "h3serve.rules.geometry",
          "h3serve.rules.long_video", "h3serve.rules.edit_mask", "h3serve.entrypoints.cli", "h3serve.entrypoints.plan",
          "h3serve.entrypoints.serve"]


def _parent_modules() -> list[str]:
    names = list(LEAVES)
    for package in (h3serve.api, h3serve.engine, h3serve.jobstore, h3serve.output_store):
        names.append(package.__name__)
        names += [info.name for info in pkgutil.walk_packages(package.__path__, package.__name__ + ".")]
    return names


def _torch_after(code: str) -> str:
    """Run `code` in a fresh interpreter; what it prints last is whether torch got imported."""
    probe = f"{code}\nimport sys\nprint('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().splitlines()[-1]


def test_parent_side_modules_do_not_import_torch():
    imports = "\n".join(f"import {name}" for name in _parent_modules())
    assert _torch_after(imports) == "False"


def test_cli_argument_parsing_does_not_import_torch():
    parse = "\n".join(
        f"try:\n    main([{', '.join(repr(a) for a in argv)}])\nexcept SystemExit:\n    pass"
        for argv in (["--help"], ["serve", "--help"], ["generate", "--help"], ["plan", "--help"], ["bench", "--help"])
    )
    code = "import contextlib, io\nfrom h3serve.entrypoints.cli import main\n"
    code += "with contextlib.redirect_stdout(io.StringIO()):\n"
    code += "\n".join("    " + line for line in parse.splitlines())
    assert _torch_after(code) == "False"


def test_the_engine_flags_are_checked_without_torch(tiny_checkpoint):
    """`h3serve serve` parses and validates every engine flag in the API process; only the ranks load torch."""
    code = (
        "import argparse\nfrom h3serve.entrypoints.engine_args import add_engine_args, engine_config_from_args\n"
        "p = argparse.ArgumentParser()\nadd_engine_args(p)\n"
        "args = p.parse_args(['--device', 'auto', '--cache-backend', 'cache_dit', '--quantization', 'fp8'])\n"
        f"engine_config_from_args(args, {str(tiny_checkpoint)!r})"
    )
    assert _torch_after(code) == "False"
