"""Every `from h3serve.X import name` in the package, the tests and the scripts resolves, the ones inside functions
too: a module moved or a name renamed without its lazy importers fails here, not when a rarely taken path runs."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _imports() -> list[tuple[Path, int, str, str | None]]:
    found = []
    for path in [*ROOT.glob("h3serve/**/*.py"), *ROOT.glob("tests/**/*.py"), *ROOT.glob("scripts/*.py")]:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("h3serve"):
                found += [(path, node.lineno, node.module, alias.name) for alias in node.names]
            elif isinstance(node, ast.Import):
                found += [(path, node.lineno, a.name, None) for a in node.names if a.name.startswith("h3serve")]
    return found


def test_every_h3serve_import_resolves():
    broken = []
    for path, line, module, name in _imports():
        where = f"{path.relative_to(ROOT)}:{line}"
        try:
            found = importlib.import_module(module)
        except ImportError as e:
            broken.append(f"{where}: {module}: {e}")
            continue
        if name is not None and name != "*" and not hasattr(found, name):
            try:
                importlib.import_module(f"{module}.{name}")
            except ImportError:
                broken.append(f"{where}: {module} has no {name}")
    assert not broken, "\n".join(broken)
