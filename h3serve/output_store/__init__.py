"""Where finished jobs' files live: the data dir (default) or an S3-compatible bucket (`--output-store s3://...`).
See docs/output_store.md."""

from __future__ import annotations

import importlib

from h3serve.errors import ConfigError
from h3serve.extras import require
from h3serve.jobstore.job_files import JobFiles
from h3serve.output_store.interface import OutputStore
from h3serve.output_store.local_folder import LocalFolderStore
from h3serve.output_store.location import SCHEME, BucketLocation, check_endpoint_url


def open_output_store(url: str | None, files: JobFiles, endpoint_url: str | None = None) -> OutputStore:
    """The store `--output-store` names (None: the data dir's job folders). `ConfigError` for a bad URL, an
    endpoint without a bucket, or a bucket without boto3 installed (`MissingExtra`, naming the extra); reaching
    the store is `check()`'s job."""
    if url is None:
        if endpoint_url is not None:
            raise ConfigError("--s3-endpoint-url needs --output-store s3://BUCKET/PREFIX")
        return LocalFolderStore(files)
    location = BucketLocation.parse(url)
    endpoint = check_endpoint_url(endpoint_url) if endpoint_url is not None else None
    require("s3", f"--output-store {SCHEME}...")  # boto3 is an optional extra: only a bucket store needs it
    module = importlib.import_module("h3serve.output_store.s3_bucket")
    store: OutputStore = module.S3BucketStore(location, endpoint)
    return store


__all__ = ["OutputStore", "open_output_store"]
