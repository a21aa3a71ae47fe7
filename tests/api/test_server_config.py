"""`h3serve serve` flags: every illegal value fails at start-up, with the flag named, before the engine starts."""

from __future__ import annotations

import pytest

from h3serve.api.server_config import ServerConfig
from h3serve.entrypoints.cli import main
from h3serve.errors import ConfigError
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
        ({"output_store": "gs://bucket/prefix"}, "--output-store"),
        ({"output_store": "s3://Bad_Bucket"}, "--output-store"),
        ({"output_redirect": True}, "--output-redirect needs --output-store"),
        ({"s3_endpoint_url": "http://127.0.0.1:7480"}, "--s3-endpoint-url needs --output-store"),
        ({"output_store": "s3://h3-out", "s3_endpoint_url": "http://key:secret@minio:9000"}, "--s3-endpoint-url"),
        ({"output_store": "s3://h3-out", "output_url_ttl_s": 8 * 24 * 3600}, "--output-url-ttl"),
        ({"output_store": "s3://h3-out", "output_upload_attempts": 0}, "--output-upload-attempts"),
        ({"webhook_allow_hosts": ("hooks.example.com/x",)}, "--webhook-allow-host"),
        ({"webhook_allow_hosts": ("127.0.0.1:99999",)}, "--webhook-allow-host"),
        ({"webhook_timeout_s": 0}, "--webhook-timeout"),
        ({"webhook_retry_initial_s": 0}, "--webhook-retry-initial"),
        ({"webhook_retry_initial_s": 60, "webhook_retry_horizon_s": 30}, "--webhook-retry-horizon"),
    ],
)
def test_illegal_values_name_the_flag(tmp_path, changes, flag):
    with pytest.raises(ConfigError, match=flag):
        ServerConfig(served_model_name="m", data_dir=tmp_path, **changes).validate()


def test_serve_refuses_a_credential_in_a_url_without_repeating_it(tiny_checkpoint, tmp_path, capsys):
    code = main(["serve", str(tiny_checkpoint), "--data-dir", str(tmp_path), "--output-store", "s3://h3-out/p",
                 "--s3-endpoint-url", "https://AKIDEXAMPLE:wJalrXUtnFEMI@minio.internal:9000"])
    err = capsys.readouterr().err
    assert code == 2 and "--s3-endpoint-url: the URL carries credentials" in err and "wJalrXUtnFEMI" not in err
    assert not (tmp_path / "jobs.sqlite3").exists()


def test_serve_exits_with_the_error_before_starting_the_engine(tiny_checkpoint, tmp_path, capsys):
    code = main(["serve", str(tiny_checkpoint), "--data-dir", str(tmp_path), "--x264-preset", "bogus"])
    assert code == 2
    assert "error: encoder: unknown x264 preset 'bogus'" in capsys.readouterr().err
    assert not (tmp_path / "jobs.sqlite3").exists()


def test_webhook_flags_reach_the_config():
    from h3serve.entrypoints.cli import build_parser

    args = build_parser().parse_args(["serve", "--webhook-allow-host", "127.0.0.1:9000", "--webhook-allow-host",
                                      "hooks.internal", "--webhook-timeout", "3", "--webhook-retry-horizon", "600"])
    assert args.webhook_allow_host == ["127.0.0.1:9000", "hooks.internal"]
    assert (args.webhook_timeout, args.webhook_retry_initial, args.webhook_retry_horizon) == (3.0, 5.0, 600.0)
    config = ServerConfig(served_model_name="m", webhook_allow_hosts=tuple(args.webhook_allow_host),
                          webhook_timeout_s=20.0).validate()
    assert [str(h) for h in config.webhook_allowed] == ["127.0.0.1:9000", "hooks.internal"]
    assert config.webhook_lease_s == 40.0  # never shorter than two attempts (the job lease is 30 s)
