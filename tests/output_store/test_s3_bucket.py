"""The bucket store on the real S3 gateway (the session's single-node Ceph): uploads (one PUT, and multipart for a
large file) with their content type and length, HEAD, ranged reads, presigned URLs of bounded lifetime, removal
(with unfinished multipart uploads), and the start-up check's clear refusals that never carry a credential."""

from __future__ import annotations

import urllib.parse

import httpx
import pytest
from ceph_gateway import SECRET_KEY, free_port

from h3serve.output_store.interface import OutputMissing, OutputStoreUnavailable, RangeNotSatisfiable
from h3serve.output_store.location import BucketLocation
from h3serve.output_store.s3_bucket import MiB, S3BucketStore

JOB = "video_" + "ab" * 16


def store_for(gateway, bucket: str, prefix: str = "outputs/h3", **kw) -> S3BucketStore:
    return S3BucketStore(BucketLocation(bucket, prefix), gateway.endpoint_url, **kw)


def test_upload_head_read_ranges_presign_and_remove(ceph_gateway, bucket, aws_env, tmp_path):
    store = store_for(ceph_gateway, bucket)
    store.check()
    data = bytes(range(256)) * 40  # 10,240 bytes
    (tmp_path / "video.mp4").write_bytes(data)
    store.upload(JOB, "video.mp4", tmp_path / "video.mp4", "video/mp4")

    raw = ceph_gateway.client().head_object(Bucket=bucket, Key=f"outputs/h3/{JOB}/video.mp4")
    assert (raw["ContentLength"], raw["ContentType"]) == (len(data), "video/mp4")  # key per job and output
    stored = store.head(JOB, "video.mp4")
    assert (stored.size, stored.content_type) == (len(data), "video/mp4")
    assert store.head(JOB, "thumbnail.webp") is None
    assert store.list_names(JOB) == ["video.mp4"]

    assert store.read(JOB, "video.mp4").read_all() == data
    part = store.read(JOB, "video.mp4", "bytes=100-1123")
    assert (part.content_range, part.length, part.total) == (f"bytes 100-1123/{len(data)}", 1024, len(data))
    assert part.read_all() == data[100:1124]
    assert store.read(JOB, "video.mp4", "bytes=-10").read_all() == data[-10:]
    with pytest.raises(RangeNotSatisfiable) as refused:
        store.read(JOB, "video.mp4", f"bytes={len(data) + 5}-")
    assert refused.value.total == len(data)

    url = store.presigned_url(JOB, "video.mp4", 120, "video/mp4", "clip.mp4")
    query = urllib.parse.parse_qs(urllib.parse.urlsplit(url).query)
    assert query["X-Amz-Expires"] == ["120"] and SECRET_KEY not in url  # bounded lifetime, signed not embedded
    fetched = httpx.get(url)
    assert fetched.status_code == 200 and fetched.content == data
    assert fetched.headers["content-disposition"] == 'attachment; filename="clip.mp4"'

    store.download(JOB, "video.mp4", tmp_path / "copy.mp4")
    assert (tmp_path / "copy.mp4").read_bytes() == data
    store.remove(JOB)
    assert store.head(JOB, "video.mp4") is None and store.list_names(JOB) == []
    with pytest.raises(OutputMissing):
        store.read(JOB, "video.mp4")


def test_a_large_file_goes_up_in_parts_and_remove_aborts_unfinished_uploads(ceph_gateway, bucket, aws_env,
                                                                           tmp_path):
    store = store_for(ceph_gateway, bucket, prefix="", part_bytes=5 * MiB)
    data = (b"0123456789abcdef" * (MiB // 16)) * 6  # 6 MiB: two parts of at least 5 MiB
    (tmp_path / "long.mp4").write_bytes(data)
    store.upload(JOB, "video.mp4", tmp_path / "long.mp4", "video/mp4")
    stored = store.head(JOB, "video.mp4")
    assert stored.size == len(data) and stored.etag.strip('"').endswith("-2")  # a two-part upload's ETag
    assert store.read(JOB, "video.mp4", "bytes=5242870-5242889").read_all() == data[5242870:5242890]

    client = ceph_gateway.client()  # a server killed mid-upload leaves an unfinished multipart upload behind
    client.create_multipart_upload(Bucket=bucket, Key=f"{JOB}/1.video.mp4")
    assert len(client.list_multipart_uploads(Bucket=bucket).get("Uploads", [])) == 1
    store.remove(JOB)
    assert client.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []
    assert client.list_objects_v2(Bucket=bucket).get("KeyCount") == 0


def test_the_start_up_check_says_why_and_never_shows_a_credential(ceph_gateway, bucket, aws_env, monkeypatch):
    with pytest.raises(OutputStoreUnavailable, match="the bucket does not exist"):
        store_for(ceph_gateway, "no-such-bucket-h3serve").check()
    dead = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(OutputStoreUnavailable, match=f"at {dead}: .*cannot reach the S3 endpoint") as down:
        S3BucketStore(BucketLocation(bucket), dead).check()
    assert "cannot reach the S3 endpoint" in down.value.reason and dead not in down.value.reason
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong-" + SECRET_KEY)
    with pytest.raises(OutputStoreUnavailable, match="access denied: the credentials were refused") as refused:
        store_for(ceph_gateway, bucket).check()
    assert SECRET_KEY not in str(refused.value) and aws_env["AWS_ACCESS_KEY_ID"] not in str(refused.value)
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    with pytest.raises(OutputStoreUnavailable, match="no usable AWS credentials in the standard chain"):
        store_for(ceph_gateway, bucket).check()


def test_the_sdk_logs_nothing_of_the_requests_even_at_debug(ceph_gateway, bucket, aws_env, tmp_path, caplog):
    caplog.set_level("DEBUG")
    store = store_for(ceph_gateway, bucket)
    (tmp_path / "a.webp").write_bytes(b"RIFF")
    store.upload(JOB, "thumbnail.webp", tmp_path / "a.webp", "image/webp")
    store.presigned_url(JOB, "thumbnail.webp", 60, "image/webp", "a.webp")
    assert not [r for r in caplog.records if r.name.split(".")[0] in ("boto3", "botocore", "s3transfer")
                and r.levelno < 30]
    assert aws_env["AWS_ACCESS_KEY_ID"] not in caplog.text and SECRET_KEY not in caplog.text
