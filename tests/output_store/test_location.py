"""`--output-store s3://BUCKET/PREFIX` and `--s3-endpoint-url`: keys per job and output, and clear refusals
(credentials in a URL are refused without being repeated)."""

from __future__ import annotations

import pytest

from h3serve.errors import ConfigError
from h3serve.output_store.location import BucketLocation, check_endpoint_url


def test_keys_are_fixed_by_the_job_and_the_output():
    location = BucketLocation.parse("s3://h3-outputs/prod/videos/")
    assert (location.bucket, location.prefix) == ("h3-outputs", "prod/videos")
    assert location.key("video_1", "1.video.mp4") == "prod/videos/video_1/1.video.mp4"
    assert BucketLocation.parse("s3://h3-outputs").key("video_1", "video.mp4") == "video_1/video.mp4"
    assert str(location) == "s3://h3-outputs/prod/videos"


@pytest.mark.parametrize(("url", "says"), [
    ("h3-outputs/prod", "expected s3://BUCKET/PREFIX"),
    ("s3://AKIA:secret@h3-outputs/prod", "credentials or ports do not belong"),
    ("s3://H3_Outputs/prod", "not a valid bucket name"),
    ("s3://ab/prod", "not a valid bucket name"),
    ("s3://h3-outputs/a//b", "segment ''"),
    ("s3://h3-outputs/a/../b", "segment '..'"),
    ("s3://h3-outputs/a b", "segment 'a b'"),
])
def test_bad_store_urls_are_refused_naming_the_rule(url, says):
    with pytest.raises(ConfigError, match="--output-store") as refused:
        BucketLocation.parse(url)
    assert says in str(refused.value) and "secret" not in str(refused.value)


def test_endpoint_urls():
    assert check_endpoint_url("http://127.0.0.1:7480/") == "http://127.0.0.1:7480"
    assert check_endpoint_url("https://storage.googleapis.com") == "https://storage.googleapis.com"
    for bad, says in (("ftp://host", "http:// or https://"), ("http://key:hunter2@host:9000", "carries credentials"),
                      ("http://host:9000/?x=1", "query"), ("http://host:99999", "bad port")):
        with pytest.raises(ConfigError, match="--s3-endpoint-url") as refused:
            check_endpoint_url(bad)
        assert says in str(refused.value) and "hunter2" not in str(refused.value)


def test_a_bucket_without_boto3_is_refused_naming_the_extra(tmp_path, monkeypatch):
    import importlib.util

    from h3serve.extras import MissingExtra
    from h3serve.jobstore.job_files import JobFiles
    from h3serve.output_store import open_output_store

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "boto3" else real(name, *a))
    with pytest.raises(MissingExtra, match=r"--output-store s3://\.\.\. needs the optional package 'boto3'.*"
                                           r"pip install 'h3serve\[s3\]'"):
        open_output_store("s3://h3-outputs/p", JobFiles(tmp_path))
