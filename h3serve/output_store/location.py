"""Where a bucket store keeps its objects: `s3://BUCKET/PREFIX` and the S3 endpoint, checked once at start-up.

Keys are `PREFIX/<job id>/<file name>` (the outputs) and `PREFIX/<job id>/inputs/<file name>` (a shared queue's
inputs): fixed by the job and the output, so a rerun writes the same keys and a delete removes one key prefix.
Credentials never appear here: a flag or URL that carries one is refused (they come from the AWS chain).
"""

from __future__ import annotations

import re
import urllib.parse
from dataclasses import dataclass

from h3serve.errors import ConfigError

SCHEME = "s3://"
# S3's bucket naming rules (Ceph, MinIO and GCS's S3 API accept these names too).
_BUCKET = re.compile(r"^(?!\d+\.\d+\.\d+\.\d+$)[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
_PREFIX_SEGMENT = re.compile(r"^[A-Za-z0-9!_.*'()-]+$")  # S3's "safe characters" for key names
MAX_PREFIX_CHARS = 512


@dataclass(frozen=True)
class BucketLocation:
    """A bucket and the key prefix under which every job's objects live ("" for the bucket's root)."""

    bucket: str
    prefix: str = ""

    @classmethod
    def parse(cls, url: str, flag: str = "--output-store") -> BucketLocation:
        """`s3://BUCKET[/PREFIX]`; `ConfigError` naming the flag and the rule otherwise."""
        if not url.startswith(SCHEME):
            raise ConfigError(f"{flag}: expected s3://BUCKET/PREFIX, got {url!r}")
        bucket, _, prefix = url[len(SCHEME):].partition("/")
        if "@" in bucket or ":" in bucket:
            raise ConfigError(f"{flag}: credentials or ports do not belong in the bucket URL; credentials come "
                              "from the AWS chain (environment, profile, instance role), the endpoint from "
                              "--s3-endpoint-url")
        if not _BUCKET.match(bucket) or ".." in bucket:
            raise ConfigError(f"{flag}: {bucket!r} is not a valid bucket name (3-63 lowercase letters, digits, "
                              "dots and hyphens, starting and ending with a letter or digit)")
        prefix = prefix.strip("/")
        if len(prefix) > MAX_PREFIX_CHARS:
            raise ConfigError(f"{flag}: the key prefix is {len(prefix)} characters; at most {MAX_PREFIX_CHARS}")
        for segment in prefix.split("/") if prefix else ():
            if segment in ("", ".", "..") or not _PREFIX_SEGMENT.match(segment):
                raise ConfigError(f"{flag}: the key prefix segment {segment!r} is not allowed (letters, digits and "
                                  "!_.*'()- between single slashes)")
        return cls(bucket, prefix)

    def job_prefix(self, job_id: str) -> str:
        """Every key of the job starts with this (it ends with a slash)."""
        return f"{self.prefix}/{job_id}/" if self.prefix else f"{job_id}/"

    def key(self, job_id: str, name: str) -> str:
        return self.job_prefix(job_id) + name

    def __str__(self) -> str:
        return f"{SCHEME}{self.bucket}/{self.prefix}" if self.prefix else f"{SCHEME}{self.bucket}"


def check_endpoint_url(url: str, flag: str = "--s3-endpoint-url") -> str:
    """An http(s) URL of an S3-compatible endpoint without credentials, a query or a fragment; `ConfigError`
    otherwise (its message never repeats a password it refused)."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"{flag}: expected an http:// or https:// URL of the S3 endpoint, got {url!r}")
    if parts.username is not None or parts.password is not None:
        raise ConfigError(f"{flag}: the URL carries credentials; set them in the AWS chain (AWS_ACCESS_KEY_ID and "
                          "AWS_SECRET_ACCESS_KEY, AWS_PROFILE, an instance role), never in a flag")
    if parts.query or parts.fragment:
        raise ConfigError(f"{flag}: the URL may not have a query or a fragment, got {url!r}")
    try:
        parts.port  # noqa: B018 (raises on a bad port)
    except ValueError:
        raise ConfigError(f"{flag}: bad port in {url!r}") from None
    return url.rstrip("/")
