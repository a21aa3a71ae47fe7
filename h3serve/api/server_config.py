"""ServerConfig: every `h3serve serve` flag that is not an engine flag, cross-checked once at start-up."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from h3serve.errors import ConfigError
from h3serve.jobstore import is_postgres_url
from h3serve.media.mp4 import EncoderOptions
from h3serve.rules import limits

MAX_BODY_BYTES = 64 * 2**20  # a whole request, uploads included


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

    @property
    def store_path(self) -> Path:
        return self.data_dir / "jobs.sqlite3"

    @property
    def jobs_dir(self) -> Path:
        return self.data_dir / "jobs"

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
            (bool(self.served_model_name), "--served-model-name must not be empty"),
        )
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)
        try:
            self.encoder_options.validate(limits.AUDIO_SAMPLE_RATE)
        except ValueError as e:  # a bad --x264-preset/--crf/--audio-bitrate fails here, not in every job
            raise ConfigError(f"encoder: {e}") from None
        if self.data_dir.exists() and not self.data_dir.is_dir():
            raise ConfigError(f"--data-dir: {self.data_dir} exists and is not a folder")
        return self
