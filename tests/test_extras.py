"""Optional features are extras: asked for without their package, they are refused at start-up, naming the extra;
the parent side and the base install import none of them."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

from h3serve import extras
from h3serve.config.engine_config import EngineConfig
from h3serve.config_checks import check_config
from h3serve.extras import EXTRAS, MissingExtra
from h3serve.jobstore import open_job_store


@pytest.fixture
def without(monkeypatch):
    """Pretend the given extras' modules are not installed."""
    missing: set[str] = set()
    real = importlib.util.find_spec
    monkeypatch.setattr(extras.importlib.util, "find_spec",
                        lambda name, *args: None if name in missing else real(name, *args))
    return missing.update


def test_a_missing_extra_is_refused_naming_it(without, tiny_checkpoint):
    without({"cache_dit", "psycopg"})
    with pytest.raises(MissingExtra, match=r"--cache-backend cache_dit needs .*pip install 'h3serve\[cache\]'"):
        check_config(EngineConfig(model=tiny_checkpoint, cache_backend="cache_dit"))
    with pytest.raises(MissingExtra, match=r"pip install 'h3serve\[postgres\]'"):
        open_job_store("postgresql://nobody@127.0.0.1:9/none")


def test_every_extra_is_installed_by_make_test_and_named_in_pyproject():
    import tomllib
    from pathlib import Path

    optional = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    assert set(EXTRAS) <= set(optional) and all(extras.installed(name) for name in EXTRAS)


def test_importing_the_server_side_loads_no_extra():
    code = ("import sys, h3serve.entrypoints.cli, h3serve.jobstore, h3serve.api.app; "
            f"print(sorted(m for m in {sorted(m for m, _ in EXTRAS.values())!r} if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]"
