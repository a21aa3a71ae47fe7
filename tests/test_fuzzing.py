"""tests/fuzzing.py: a fuzz test's seed draws one example set, whatever modules the worker imported before it."""

from __future__ import annotations

import importlib
import sys

from fuzzing import fixed_constants
from hypothesis import given, seed, settings
from hypothesis import strategies as st

MARKER = "fuzz-marker"


def _draws() -> list[str]:
    drawn: list[str] = []

    @seed(7)
    @given(st.text(min_size=1, max_size=32))
    @settings(max_examples=400, database=None, derandomize=False)
    def draw(text: str) -> None:
        drawn.append(text)

    draw()
    return drawn


def test_the_pool_is_the_named_packages_whatever_else_is_imported(tmp_path, monkeypatch):
    package = tmp_path / "late_constants"
    package.mkdir()
    (package / "__init__.py").write_text("".join(f'NAME_{i} = "{MARKER}-{i}"\n' for i in range(50)))
    monkeypatch.syspath_prepend(str(tmp_path))
    with fixed_constants("h3serve.rules"):
        before = _draws()
    try:
        importlib.import_module("late_constants")  # local code with new constants, as another test file's imports
        with fixed_constants("h3serve.rules"):
            assert _draws() == before  # hypothesis' own harvest would now mix the new module's constants in
        with fixed_constants("late_constants"):  # and the pool is what the draws take their constants from
            assert any(text.startswith(MARKER) for text in _draws())
    finally:
        sys.modules.pop("late_constants", None)
