"""The optional features and the extra that installs each (`pip install 'h3serve[NAME]'`); `make demo` and
`make test` install them all. A feature asked for without its package is refused at start-up, naming the extra."""

from __future__ import annotations

import importlib.util

from h3serve.errors import ConfigError

EXTRAS: dict[str, tuple[str, str]] = {  # extra -> (the module it provides, what it is for)
    "postgres": ("psycopg", "one job queue shared by many servers (--job-store postgresql://)"),
    "cache": ("cache_dit", "the DiT block cache (--cache-backend cache_dit, quality=high)"),
    "plots": ("matplotlib", "the plots of `h3serve bench` and `h3serve train-demo`"),
    "fidelity": ("skimage", "SSIM in `h3serve compare` and the bench's fidelity columns"),
    "s3": ("boto3", "outputs in an S3-compatible bucket (--output-store s3://BUCKET/PREFIX)"),
}


class MissingExtra(ConfigError):
    """A feature was asked for whose optional package is not installed."""

    code = "missing_extra"


def installed(extra: str) -> bool:
    return importlib.util.find_spec(EXTRAS[extra][0]) is not None


def require(extra: str, asked_by: str) -> None:
    """Refuse `asked_by` (a flag, a command) unless the extra's package is installed."""
    if not installed(extra):
        module, purpose = EXTRAS[extra]
        raise MissingExtra(f"{asked_by} needs the optional package {module!r} ({purpose}): "
                           f"pip install 'h3serve[{extra}]'")
