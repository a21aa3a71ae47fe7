"""ServerConfig: every `h3serve serve` flag that is not an engine flag, cross-checked once at start-up."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from h3serve.engine.outbox.sender import AllowedHost
from h3serve.errors import ConfigError
from h3serve.jobstore import is_postgres_url
from h3serve.media.mp4 import EncoderOptions
from h3serve.output_store.location import BucketLocation, check_endpoint_url
from h3serve.rules import limits

MAX_BODY_BYTES = 64 * 2**20  # a whole request, uploads included
MAX_PRESIGNED_URL_S = 7 * 24 * 3600  # SigV4's longest presigned URL lifetime
MAX_UPLOAD_ATTEMPTS = 20


def default_data_dir() -> Path:
    """`$H3SERVE_DATA_DIR`, else `$XDG_DATA_HOME/h3serve`, else `~/.local/share/h3serve`."""
    if env := os.environ.get("H3SERVE_DATA_DIR"):
        return Path(env).expanduser()
    base = os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share"
    return Path(base) / "h3serve"


@dataclass(frozen=True)
class ServerConfig:
    served_model_name: str
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None  # Bearer token every /v1 route requires; None: open
    data_dir: Path = field(default_factory=default_data_dir)  # jobs.sqlite3 + jobs/<id>/ folders
    job_store: str | None = None  # a postgresql:// URL shared by several servers; None: jobs.sqlite3 in data_dir
    job_lease_s: float = 30.0  # a dead server's running job is claimed again this long after its last renewal
    overlap_output: bool = True  # write a job's MP4 while its replica runs the next job (h3serve.engine.jobs)
    output_store: str | None = None  # s3://BUCKET/PREFIX: outputs in an S3-compatible bucket; None: the data dir
    s3_endpoint_url: str | None = None  # the bucket's S3 endpoint (MinIO, Ceph, GCS); None: AWS's, from the chain
    output_redirect: bool = False  # downloads answer 302 to a presigned bucket URL instead of streaming the bytes
    output_url_ttl_s: int = 300  # how long a presigned download URL stays valid
    output_upload_attempts: int = 5  # tries at putting a job's outputs into the bucket before the job fails
    max_queue: int = 16  # queued jobs (the running one excluded) before 429
    sync_timeout_s: float = 600.0  # /v1/videos/sync: 504 and the job is aborted after this
    output_ttl_s: float = 86_400.0  # outputs are deleted this long after a job finishes; 0: never
    sweep_interval_s: float = 60.0
    poll_after_ms: int = 1000  # `openai-poll-after-ms` on retrieve: the SDK's polling interval
    allow_private_media_urls: bool = False  # let media URLs reach loopback/private/link-local hosts
    control_dir: Path | None = None  # --control-dir: the only root a request's ControlNet paths may name
    media_fetch_timeout_s: float = 30.0  # every media URL of one request together
    max_body_bytes: int = MAX_BODY_BYTES
    header_timeout_s: float = 10.0  # a connection's request line and headers must arrive within this
    body_timeout_s: float = 30.0  # a request body may pause this long; its whole deadline scales with its length
    keep_alive_timeout_s: float = 5.0  # an idle keep-alive connection is closed after this
    max_connections: int = 1000  # open connections; past it a new one gets 503 and is closed
    shutdown_grace_s: float = 10.0  # SIGTERM: the running job may finish within this, else it is requeued
    max_request_cost: float | None = None  # h3serve.engine.admission's cost; None: derived from the checkpoint
    job_timeout_s: float | None = None  # a job running longer fails with code `timeout`; None: no limit
    stall_timeout_s: float = 600.0  # /health says unhealthy when the running job made no progress for this long
    encoder_options: EncoderOptions = field(default_factory=EncoderOptions)
    realtime: bool = False  # the engine has --realtime-lora: WS /v1/realtime/video serves sessions
    realtime_start_timeout_s: float = limits.REALTIME_START_TIMEOUT_S  # session.start must come within this
    realtime_stall_timeout_s: float = limits.REALTIME_STALL_TIMEOUT_S  # a session with no progress this long ends
    # Webhooks (docs/webhooks.md): hosts a webhook URL may reach over http and at any address (HOST[:PORT]; the
    # rest must be https to a public address), one attempt's deadline, the retries' first delay and horizon.
    webhook_allow_hosts: tuple[str, ...] = ()
    webhook_timeout_s: float = limits.WEBHOOK_TIMEOUT_S
    webhook_retry_initial_s: float = limits.WEBHOOK_RETRY_INITIAL_S
    webhook_retry_horizon_s: float = limits.WEBHOOK_RETRY_HORIZON_S
    webhook_poll_s: float = 1.0  # due retries and other servers' events are looked for this often

    @property
    def store_path(self) -> Path:
        return self.data_dir / "jobs.sqlite3"

    @property
    def jobs_dir(self) -> Path:
        return self.data_dir / "jobs"

    @property
    def webhook_lease_s(self) -> float:
        """A delivery attempt's lease: the jobs' (a dead server's deliveries are taken over as soon as its jobs),
        but never shorter than two attempts, so a live server never loses the delivery it is sending."""
        return max(self.job_lease_s, 2 * self.webhook_timeout_s)

    @property
    def webhook_allowed(self) -> tuple[AllowedHost, ...]:
        return tuple(AllowedHost.parse(host) for host in self.webhook_allow_hosts)

    def validate(self) -> ServerConfig:
        """Fail loudly, at start-up, on any illegal value."""
        checks = (
            (0 <= self.port <= 65535, f"--port must be in 0..65535, got {self.port}"),
            (self.max_queue >= 1, f"--max-queue must be >= 1, got {self.max_queue}"),
            (self.sync_timeout_s > 0, f"--sync-timeout must be > 0 seconds, got {self.sync_timeout_s:g}"),
            (self.output_ttl_s >= 0, f"--output-ttl must be >= 0 seconds (0: keep), got {self.output_ttl_s:g}"),
            (self.sweep_interval_s > 0, f"--ttl-sweep-interval must be > 0, got {self.sweep_interval_s:g}"),
            (self.poll_after_ms >= 1, f"--poll-after-ms must be >= 1, got {self.poll_after_ms}"),
            (self.media_fetch_timeout_s > 0, f"--media-fetch-timeout must be > 0, got {self.media_fetch_timeout_s:g}"),
            (self.header_timeout_s > 0, f"--header-timeout must be > 0, got {self.header_timeout_s:g}"),
            (self.body_timeout_s > 0, f"--body-timeout must be > 0, got {self.body_timeout_s:g}"),
            (self.keep_alive_timeout_s > 0, f"--keep-alive-timeout must be > 0, got {self.keep_alive_timeout_s:g}"),
            (self.max_connections >= 1, f"--max-connections must be >= 1, got {self.max_connections}"),
            (self.shutdown_grace_s >= 0, f"--shutdown-grace must be >= 0, got {self.shutdown_grace_s:g}"),
            (self.max_request_cost is None or self.max_request_cost > 0, "--max-request-cost must be > 0"),
            (self.job_timeout_s is None or self.job_timeout_s > 0, "--job-timeout must be > 0 seconds"),
            (self.stall_timeout_s > 0, f"--stall-timeout must be > 0, got {self.stall_timeout_s:g}"),
            (self.realtime_start_timeout_s > 0,
             f"--realtime-start-timeout must be > 0, got {self.realtime_start_timeout_s:g}"),
            (self.realtime_stall_timeout_s > 0,
             f"--realtime-stall-timeout must be > 0, got {self.realtime_stall_timeout_s:g}"),
            (self.job_store is None or is_postgres_url(self.job_store),
             f"--job-store: expected a postgresql://USER@HOST/DB URL, got {self.job_store!r}"),
            (self.job_lease_s >= 1, f"--job-lease must be >= 1 second, got {self.job_lease_s:g}"),
            (self.api_key is None or self.api_key.strip() != "", "--api-key must not be empty"),
            (not self.output_redirect or self.output_store is not None,
             "--output-redirect needs --output-store s3://BUCKET/PREFIX (the data dir has no URLs to redirect to)"),
            (self.s3_endpoint_url is None or self.output_store is not None,
             "--s3-endpoint-url needs --output-store s3://BUCKET/PREFIX"),
            (1 <= self.output_url_ttl_s <= MAX_PRESIGNED_URL_S,
             f"--output-url-ttl must be 1..{MAX_PRESIGNED_URL_S} seconds (7 days), got {self.output_url_ttl_s}"),
            (1 <= self.output_upload_attempts <= MAX_UPLOAD_ATTEMPTS,
             f"--output-upload-attempts must be 1..{MAX_UPLOAD_ATTEMPTS}, got {self.output_upload_attempts}"),
            (self.webhook_timeout_s > 0, f"--webhook-timeout must be > 0, got {self.webhook_timeout_s:g}"),
            (self.webhook_retry_initial_s > 0, f"--webhook-retry-initial must be > 0, got "
             f"{self.webhook_retry_initial_s:g}"),
            (self.webhook_retry_horizon_s >= self.webhook_retry_initial_s,
             f"--webhook-retry-horizon must be >= --webhook-retry-initial, got {self.webhook_retry_horizon_s:g}"),
            (self.webhook_poll_s > 0, f"the webhook poll interval must be > 0, got {self.webhook_poll_s:g}"),
            (bool(self.served_model_name), "--served-model-name must not be empty"),
        )
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)
        try:
            self.encoder_options.validate(limits.AUDIO_SAMPLE_RATE)
        except ValueError as e:  # a bad --x264-preset/--crf/--audio-bitrate fails here, not in every job
            raise ConfigError(f"encoder: {e}") from None
        if self.output_store is not None:
            BucketLocation.parse(self.output_store)
        if self.s3_endpoint_url is not None:
            check_endpoint_url(self.s3_endpoint_url)
        try:
            self.webhook_allowed  # noqa: B018 (parsed here so that a bad one fails at start-up)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if self.data_dir.exists() and not self.data_dir.is_dir():
            raise ConfigError(f"--data-dir: {self.data_dir} exists and is not a folder")
        return self
