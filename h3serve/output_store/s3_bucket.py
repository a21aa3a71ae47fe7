"""The output store in an S3-compatible bucket (AWS S3, MinIO, Ceph's RADOS gateway, GCS's S3 API) through boto3:
streamed multipart uploads with the content type set, HEAD checks, ranged reads passed through to the bucket,
presigned GET URLs, and removal of a job's objects (its unfinished multipart uploads aborted too).

Credentials come only from the standard AWS chain (environment, profile, instance or task role); they are never a
flag, never logged, and never part of an error: every failure is re-raised as `OutputStoreUnavailable` whose
message is written here from the error's code, not copied from the SDK.
"""

from __future__ import annotations

import logging
import re
import secrets
from pathlib import Path
from typing import Any

import boto3
from boto3.exceptions import S3UploadFailedError
from boto3.s3.transfer import TransferConfig
from botocore.config import Config
from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    ConnectionClosedError,
    ConnectTimeoutError,
    EndpointConnectionError,
    NoCredentialsError,
    PartialCredentialsError,
    ReadTimeoutError,
)

from h3serve.media.raw import atomic_output
from h3serve.output_store.interface import (
    CHUNK_BYTES,
    ObjectRead,
    OutputMissing,
    OutputStoreUnavailable,
    RangeNotSatisfiable,
    StoredObject,
)
from h3serve.output_store.location import BucketLocation

MiB = 2**20
PART_BYTES = 16 * MiB  # files above this go up in parts of this size (S3's minimum part is 5 MiB)
UPLOAD_CONCURRENCY = 4  # parts of one file in flight at once
MAX_RANGE_HEADER = 200
_MISSING = {"NoSuchKey", "NotFound", "404"}
_REASONS = {  # the S3 error codes whose cause an operator can act on, said plainly
    "NoSuchBucket": "the bucket does not exist",
    "AccessDenied": "access denied: the credentials may not use this bucket",
    "AllAccessDisabled": "access denied: the credentials may not use this bucket",
    "InvalidAccessKeyId": "the S3 service does not know the access key (AWS credentials chain)",
    "SignatureDoesNotMatch": "the secret key does not match the access key (AWS credentials chain)",
    "RequestTimeTooSkewed": "this machine's clock is too far from the S3 service's",
    "SlowDown": "the S3 service asks to slow down",
    "ServiceUnavailable": "the S3 service is unavailable",
    "InternalError": "the S3 service had an internal error",
    "403": "access denied: the credentials were refused (a wrong key or secret) or may not use this bucket",
}
_CONNECTION_ERRORS = (EndpointConnectionError, ConnectTimeoutError, ReadTimeoutError, ConnectionClosedError)
# The SDK's debug logs print signed request headers (the access key id among them): never, even at --log-level debug.
SDK_LOGGERS = ("boto3", "botocore", "s3transfer")


class S3BucketStore:
    """Outputs as objects `PREFIX/<job id>/<file name>` of one bucket. Thread-safe (one boto3 client, which is)."""

    remote = True

    def __init__(self, location: BucketLocation, endpoint_url: str | None = None, *, part_bytes: int = PART_BYTES):
        for name in SDK_LOGGERS:
            logging.getLogger(name).setLevel(logging.WARNING)
        self.location = location
        self.endpoint_url = endpoint_url
        session = boto3.session.Session()
        self.client = session.client(
            "s3",
            endpoint_url=endpoint_url,
            region_name=session.region_name or "us-east-1",  # SigV4 needs one; S3-compatible servers ignore it
            config=Config(
                signature_version="s3v4",
                connect_timeout=5,
                read_timeout=60,
                retries={"mode": "standard", "max_attempts": 2},  # the publisher retries a whole file with backoff
                # Path-style keys for a custom endpoint (an IP or a host without wildcard DNS); AWS picks itself.
                s3={"addressing_style": "path" if endpoint_url else "auto"},
                # Checksums only where the API requires them: S3-compatible servers differ in the newer ones.
                request_checksum_calculation="when_required",
                response_checksum_validation="when_required",
                max_pool_connections=32,
            ),
        )
        self.transfer = TransferConfig(multipart_threshold=part_bytes, multipart_chunksize=part_bytes,
                                       max_concurrency=UPLOAD_CONCURRENCY)

    def describe(self) -> str:
        at = f" at {self.endpoint_url}" if self.endpoint_url else ""
        return f"the bucket {self.location}{at}"

    def _key(self, job_id: str, name: str) -> str:
        return self.location.key(job_id, name)

    def _unavailable(self, error: Exception, doing: str) -> OutputStoreUnavailable:
        """The store's failure, said without the SDK's own text (which may carry request details)."""
        if isinstance(error, NoCredentialsError | PartialCredentialsError):
            reason = ("no usable AWS credentials in the standard chain (AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, "
                      "AWS_PROFILE or ~/.aws/credentials, an instance or task role)")
        elif isinstance(error, _CONNECTION_ERRORS):
            reason = "cannot reach the S3 endpoint"
        else:
            code = _error_code(error)
            reason = _REASONS.get(code, f"the S3 service answered {code}" if code else type(error).__name__)
        return OutputStoreUnavailable(f"{self.describe()}: {doing} failed: {reason}", f"{doing} failed: {reason}")

    def check(self) -> None:
        """The bucket exists and takes a write and a delete under the prefix (a small probe object)."""
        probe = f"{self.location.prefix}/" if self.location.prefix else ""
        probe += f".h3serve-write-check-{secrets.token_hex(6)}"
        try:
            self.client.head_bucket(Bucket=self.location.bucket)
            self.client.put_object(Bucket=self.location.bucket, Key=probe, Body=b"", ContentType="text/plain")
            self.client.delete_object(Bucket=self.location.bucket, Key=probe)
        except (BotoCoreError, ClientError) as e:
            if _error_code(e) in _MISSING:  # HEAD on a missing bucket answers a bare 404
                raise OutputStoreUnavailable(f"{self.describe()}: the bucket does not exist",
                                             "the bucket does not exist") from None
            raise self._unavailable(e, "the start-up check (HEAD bucket, write and delete a probe object)") from None

    def upload(self, job_id: str, name: str, path: Path, content_type: str) -> None:
        """Stream `path` to its key (in parts above `PART_BYTES`), with its content type; the object appears
        whole or not at all (a multipart upload becomes visible only when it completes)."""
        try:
            self.client.upload_file(str(path), self.location.bucket, self._key(job_id, name),
                                    ExtraArgs={"ContentType": content_type}, Config=self.transfer)
        except (BotoCoreError, ClientError, S3UploadFailedError) as e:
            raise self._unavailable(e, f"uploading {name} of {job_id}") from None

    def head(self, job_id: str, name: str) -> StoredObject | None:
        try:
            answer = self.client.head_object(Bucket=self.location.bucket, Key=self._key(job_id, name))
        except (BotoCoreError, ClientError) as e:
            if _error_code(e) in _MISSING:
                return None
            raise self._unavailable(e, f"checking {name} of {job_id}") from None
        return StoredObject(int(answer["ContentLength"]), answer.get("ContentType"), answer.get("ETag"))

    def local_path(self, job_id: str, name: str) -> None:
        return None

    def read(self, job_id: str, name: str, byte_range: str | None = None) -> ObjectRead:
        """GET the object; `byte_range` (the client's Range header) goes to the bucket as it came."""
        request: dict[str, Any] = {"Bucket": self.location.bucket, "Key": self._key(job_id, name)}
        if byte_range and len(byte_range) <= MAX_RANGE_HEADER:
            request["Range"] = byte_range
        try:
            answer = self.client.get_object(**request)
        except (BotoCoreError, ClientError) as e:
            code = _error_code(e)
            if code in _MISSING:
                raise OutputMissing(f"{name} of {job_id} is not in {self.describe()}") from None
            if code == "InvalidRange":
                stored = self.head(job_id, name)
                raise RangeNotSatisfiable(stored.size if stored else None) from None
            raise self._unavailable(e, f"reading {name} of {job_id}") from None
        body = answer["Body"]
        content_range = answer.get("ContentRange")
        length = int(answer["ContentLength"])
        total = int(content_range.rsplit("/", 1)[1]) if content_range and "/" in content_range else length
        return ObjectRead(
            chunks=body.iter_chunks(CHUNK_BYTES), length=length, total=total, content_type=answer.get("ContentType"),
            close=body.close, content_range=content_range, etag=answer.get("ETag"),
            last_modified=answer.get("LastModified"),
        )

    def download(self, job_id: str, name: str, dest: Path) -> None:
        try:
            with atomic_output(dest) as tmp:
                self.client.download_file(self.location.bucket, self._key(job_id, name), str(tmp),
                                          Config=self.transfer)
        except (BotoCoreError, ClientError) as e:
            if _error_code(e) in _MISSING:
                raise OutputMissing(f"{name} of {job_id} is not in {self.describe()}") from None
            raise self._unavailable(e, f"downloading {name} of {job_id}") from None

    def presigned_url(self, job_id: str, name: str, expires_s: int, content_type: str, filename: str) -> str:
        """A GET URL signed for `expires_s` seconds that answers with the given content type and file name."""
        params = {"Bucket": self.location.bucket, "Key": self._key(job_id, name),
                  "ResponseContentType": content_type,
                  "ResponseContentDisposition": f'attachment; filename="{filename}"'}
        try:
            return str(self.client.generate_presigned_url("get_object", Params=params, ExpiresIn=expires_s))
        except (BotoCoreError, ClientError) as e:
            raise self._unavailable(e, f"signing a URL for {name} of {job_id}") from None

    def list_names(self, job_id: str, under: str = "") -> list[str]:
        prefix = self.location.job_prefix(job_id)
        names: list[str] = []
        try:
            for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.location.bucket,
                                                                               Prefix=prefix + under):
                names += [item["Key"][len(prefix):] for item in page.get("Contents", [])]
        except (BotoCoreError, ClientError) as e:
            raise self._unavailable(e, f"listing the objects of {job_id}") from None
        return sorted(names)

    def remove(self, job_id: str) -> None:
        """Delete every object under the job's prefix and abort its unfinished multipart uploads (a server killed
        mid-upload leaves one). One DELETE per object: a job has a few, and every S3 server takes it."""
        bucket, prefix = self.location.bucket, self.location.job_prefix(job_id)
        try:
            for name in self.list_names(job_id):
                self.client.delete_object(Bucket=bucket, Key=prefix + name)
            for page in self.client.get_paginator("list_multipart_uploads").paginate(Bucket=bucket, Prefix=prefix):
                for upload in page.get("Uploads", []):
                    self.client.abort_multipart_upload(Bucket=bucket, Key=upload["Key"], UploadId=upload["UploadId"])
        except (BotoCoreError, ClientError) as e:
            raise self._unavailable(e, f"removing the objects of {job_id}") from None


def _error_code(error: Exception) -> str:
    """The S3 error code (`NoSuchKey`, `AccessDenied`, or the HTTP status of a bare HEAD answer), or ""."""
    if isinstance(error, ClientError):
        return str(error.response.get("Error", {}).get("Code", ""))
    if isinstance(error, S3UploadFailedError):  # s3transfer keeps only the text: "An error occurred (Code) ..."
        match = re.search(r"\((\w+)\)", str(error))
        return match.group(1) if match else ""
    return ""
