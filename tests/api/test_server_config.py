"""`h3serve serve` flags: every illegal value fails at start-up, with the flag named, before the engine starts."""

from __future__ import annotations

import pytest

from h3serve.api.server_config import ServerConfig
from h3serve.config import ConfigError
from h3serve.entrypoints.cli import main
from h3serve.media.mp4 import EncoderOptions


@pytest.mark.parametrize(
    "changes, flag",
    [
        ({"max_queue": 0}, "--max-queue"),
        ({"sync_timeout_s": 0}, "--sync-timeout"),
        ({"output_ttl_s": -1}, "--output-ttl"),
        ({"port": 70000}, "--port"),
        ({"api_key": " "}, "--api-key"),
        ({"encoder_options": EncoderOptions(crf=99)}, "encoder"),
        ({"job_store": "mysql://db/jobs"}, "--job-store"),
        ({"job_lease_s": 0.5}, "--job-lease"),
    ],
)
def test_illegal_values_name_the_flag(tmp_path, changes, flag):
    with pytest.raises(ConfigError, match=flag):
        ServerConfig(served_model_name="m", data_dir=tmp_path, **changes).validate()


def test_serve_exits_with_the_error_before_starting_the_engine(tiny_checkpoint, tmp_path, capsys):
    code = main(["serve", str(tiny_checkpoint), "--data-dir", str(tmp_path), "--x264-preset", "bogus"])
    assert code == 2
    assert "error: encoder: unknown x264 preset 'bogus'" in capsys.readouterr().err
    assert not (tmp_path / "jobs.sqlite3").exists()
