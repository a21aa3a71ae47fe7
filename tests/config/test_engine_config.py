"""`EngineConfig` is a leaf: importing it loads nothing of h3serve but the config room and the errors."""

from __future__ import annotations

import subprocess
import sys

import pytest

from h3serve.config.engine_config import EngineConfig
from h3serve.config_checks import check_config
from h3serve.errors import ConfigError


def test_the_config_room_imports_only_itself_and_the_errors():
    loaded = subprocess.run(
        [sys.executable, "-c", "import sys, h3serve.config.engine_config; "
         "print(' '.join(sorted(m for m in sys.modules if m.startswith('h3serve'))))"],
        capture_output=True, text=True, check=True,
    ).stdout.split()
    assert loaded == ["h3serve", "h3serve.config", "h3serve.config.engine_config", "h3serve.config.offload_config",
                      "h3serve.config.quantization_config", "h3serve.errors"]


def test_a_config_is_a_value_until_it_is_checked(tiny_checkpoint, tmp_path):
    # building one reads nothing and refuses nothing; `check_config` does both, naming the flag
    bad = EngineConfig(model=tmp_path / "absent", device="tpu", max_output_batch=0)
    with pytest.raises(ConfigError, match="--device: unknown device 'tpu'"):
        check_config(bad)
    with pytest.raises(ConfigError, match="--model: "):
        check_config(EngineConfig(model=tmp_path / "absent"))
    good = EngineConfig(model=tiny_checkpoint, device="cpu")
    assert check_config(good) is good
