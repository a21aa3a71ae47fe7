"""`h3serve serve [MODEL_DIR]`: start the engine, then the OpenAI-compatible HTTP API on uvicorn."""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from h3serve.entrypoints.cli_util import EXIT_ERROR, EXIT_USAGE, fail, model_dir
from h3serve.errors import ConfigError

if TYPE_CHECKING:
    from h3serve.api.server_config import ServerConfig
    from h3serve.config.engine_config import EngineConfig
    from h3serve.engine.executor import Executor
    from h3serve.engine.jobs import JobManager
    from h3serve.jobstore.job_files import JobFiles
    from h3serve.jobstore.store import JobStore
    from h3serve.output_store.interface import OutputStore
    from h3serve.parallel.rendezvous import Rendezvous

log = logging.getLogger("h3serve.serve")
RUNNER_JOIN_S = 60.0  # after the ranks are killed the runner only records the requeue: seconds at most


def _default(cls: type, name: str) -> Any:
    """A dataclass field's default, so each flag's default is defined once, on the config it fills."""
    return cls.__dataclass_fields__[name].default


def register(sub: argparse._SubParsersAction) -> None:
    from h3serve.api.server_config import ServerConfig
    from h3serve.entrypoints.engine_args import add_engine_args
    from h3serve.media.mp4 import EncoderOptions

    def server(name: str) -> Any:
        return _default(ServerConfig, name)

    def encoder(name: str) -> Any:
        return _default(EncoderOptions, name)

    p = sub.add_parser("serve", help="serve the OpenAI-compatible /v1/videos API")
    _add_server_args(p, server)
    _add_limit_args(p, server, encoder)
    _add_webhook_args(p, server)
    add_engine_args(p)  # device, parallel layout (--num-gpus, -tp, --usp, --ring, ...), vLLM-Omni recipe flags
    p.set_defaults(func=cmd_serve)


def _add_server_args(p: argparse.ArgumentParser, server: Callable[[str], Any]) -> None:
    """Where to serve and where the jobs are kept."""
    from h3serve.config.engine_config import WARMUP_DEFAULT

    p.add_argument("model_dir", nargs="?", metavar="MODEL_DIR",
                   help="checkpoint folder (default: the tiny checkpoint, built on first use)")
    p.add_argument("--host", default=server("host"), help="address to bind (default %(default)s)")
    p.add_argument("--port", type=int, default=server("port"), help="port to bind (default %(default)s)")
    p.add_argument("--api-key", default=os.environ.get("H3SERVE_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1 routes (default: $H3SERVE_API_KEY)")
    p.add_argument("--data-dir", type=Path,
                   help="jobs, inputs and outputs (default: $H3SERVE_DATA_DIR, else ~/.local/share/h3serve); "
                        "one server per data dir, except with a shared --job-store")
    p.add_argument("--job-store", metavar="URL", default=server("job_store"),
                   help="postgresql://USER@HOST/DB: a job queue shared by every server on that database (then "
                        "--data-dir must be one shared folder, or the outputs go to one --output-store bucket; see "
                        "docs/scaling.md); default: jobs.sqlite3 in the data dir")
    p.add_argument("--output-store", metavar="URL", default=server("output_store"),
                   help="s3://BUCKET/PREFIX: every output goes to this S3-compatible bucket (credentials from the "
                        "AWS chain: environment, profile, instance role; see docs/output_store.md); default: the "
                        "data dir")
    p.add_argument("--s3-endpoint-url", metavar="URL", default=server("s3_endpoint_url"),
                   help="the bucket's S3 endpoint for MinIO, Ceph, GCS and other S3-compatible services "
                        "(default: AWS's, or AWS_ENDPOINT_URL)")
    p.add_argument("--output-redirect", action="store_true", default=server("output_redirect"),
                   help="downloads answer 302 to a presigned bucket URL instead of streaming through this server")
    p.add_argument("--output-url-ttl", type=int, default=server("output_url_ttl_s"),
                   help="seconds a presigned download URL stays valid (default %(default)s)")
    p.add_argument("--output-upload-attempts", type=int, default=server("output_upload_attempts"),
                   help="tries at uploading a job's outputs, with exponential backoff, before the job fails "
                        "(default %(default)s)")
    p.add_argument("--job-lease", type=float, default=server("job_lease_s"),
                   help="seconds after a server's last lease renewal before another may rerun its job "
                        "(default %(default)g)")
    p.add_argument("--warmup", default=WARMUP_DEFAULT, metavar="default|off|WxHxFRAMES,...",
                   help="T2VA request shapes each rank runs once before /health reports ready, so the first request "
                   "finds the DiT compiled, the kernels planned, the memory pools and the default schedule's AdaLN "
                   "memo ready (default: %(default)s, the checkpoint's default shape; off: none). "
                   "--init-timeout covers it")
    p.add_argument("--no-overlap-output", dest="overlap_output", action="store_false",
                   default=server("overlap_output"),
                   help="write each job's MP4 before its replica takes the next job (default: the mux overlaps "
                        "the next job's run)")
    p.add_argument("--served-model-name", help="the model id clients see (default: the checkpoint folder name)")
    p.add_argument("--max-queue", type=int, default=server("max_queue"),
                   help="queued jobs before 429 (default %(default)s)")
    p.add_argument("--sync-timeout", type=float, default=server("sync_timeout_s"),
                   help="/v1/videos/sync timeout in s (default %(default)g)")
    p.add_argument("--output-ttl", type=float, default=server("output_ttl_s"),
                   help="seconds a finished job's files are kept (default %(default)g; 0 keeps them)")
    p.add_argument("--ttl-sweep-interval", type=float, default=server("sweep_interval_s"),
                   help="seconds between expiry sweeps (default %(default)g)")
    p.add_argument("--poll-after-ms", type=int, default=server("poll_after_ms"),
                   help="openai-poll-after-ms on retrieve (default %(default)s)")


def _add_limit_args(p: argparse.ArgumentParser, server: Callable[[str], Any], encoder: Callable[[str], Any]) -> None:
    """Request and connection limits, timeouts, the MP4 encoder."""
    from h3serve.media.mp4 import VIDEO_ENCODER_HELP
    from h3serve.rules.names import VIDEO_ENCODERS

    p.add_argument("--allow-private-media-urls", action="store_true",
                   help="let media URLs reach loopback, private and link-local addresses")
    p.add_argument("--control-dir", type=Path, metavar="DIR",
                   help="the only folder a request's ControlNet control_path / source_path / mask_path may name "
                   "(default: none, uploads only)")
    p.add_argument("--media-fetch-timeout", type=float, default=server("media_fetch_timeout_s"),
                   help="seconds for all media URLs of one request together (default %(default)g)")
    p.add_argument("--header-timeout", type=float, default=server("header_timeout_s"),
                   help="seconds a connection has to send its request headers (default %(default)g)")
    p.add_argument("--body-timeout", type=float, default=server("body_timeout_s"),
                   help="seconds a request body may send nothing; the whole body must arrive within this plus "
                        "1 s per 64 KiB declared (default %(default)g)")
    p.add_argument("--keep-alive-timeout", type=float, default=server("keep_alive_timeout_s"),
                   help="seconds an idle keep-alive connection stays open (default %(default)g)")
    p.add_argument("--max-connections", type=int, default=server("max_connections"),
                   help="open connections before new ones get 503 (default %(default)s)")
    p.add_argument("--shutdown-grace", type=float, default=server("shutdown_grace_s"),
                   help="SIGTERM: seconds the running job may take to finish before it is requeued "
                        "(default %(default)g)")
    p.add_argument("--max-request-cost", type=float, default=server("max_request_cost"),
                   help="refuse requests costing more: width x height x frames x steps / 1e6 (default: the "
                        "checkpoint's largest canvas at 15 s and 100 steps, i.e. forwards)")
    p.add_argument("--job-timeout", type=float, default=server("job_timeout_s"),
                   help="seconds a job may run before it fails with code 'timeout' (default: no limit)")
    p.add_argument("--stall-timeout", type=float, default=server("stall_timeout_s"),
                   help="/health is 503 when the running job made no progress for this long (default %(default)g)")
    p.add_argument("--realtime-start-timeout", type=float, default=server("realtime_start_timeout_s"),
                   help="WS /v1/realtime/video: seconds a client has to send session.start (default %(default)g)")
    p.add_argument("--realtime-stall-timeout", type=float, default=server("realtime_stall_timeout_s"),
                   help="WS /v1/realtime/video: a session with no new chunk (or client ping) for this long ends "
                        "(default %(default)g)")
    p.add_argument("--x264-preset", default=encoder("preset"), help="x264 preset (default %(default)s)")
    p.add_argument("--crf", type=int, default=encoder("crf"), help="x264 constant rate factor (default %(default)s)")
    p.add_argument("--video-encoder", choices=VIDEO_ENCODERS, default=encoder("encoder"), help=VIDEO_ENCODER_HELP)
    p.add_argument("--audio-bitrate", type=int, default=encoder("audio_bitrate"),
                   help="AAC bitrate in bit/s (default %(default)s)")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))


def _add_webhook_args(p: argparse.ArgumentParser, server: Callable[[str], Any]) -> None:
    """Webhook deliveries (docs/webhooks.md): which hosts they may reach, their deadline and their retries."""
    p.add_argument("--webhook-allow-host", action="append", default=[], metavar="HOST[:PORT]",
                   help="let webhook URLs on this host (and port) use http and reach loopback or private addresses "
                   "(repeatable; default: https to public addresses only)")
    p.add_argument("--webhook-timeout", type=float, default=server("webhook_timeout_s"),
                   help="seconds one delivery attempt may take, connection and answer (default %(default)g)")
    p.add_argument("--webhook-retry-initial", type=float, default=server("webhook_retry_initial_s"),
                   help="seconds before the first retry of a failed delivery; each later one waits twice as long, "
                   "at most an hour, with jitter (default %(default)g)")
    p.add_argument("--webhook-retry-horizon", type=float, default=server("webhook_retry_horizon_s"),
                   help="seconds after its event that a delivery is retried before it is marked failed "
                   "(default %(default)g)")


def cmd_serve(args: argparse.Namespace) -> int:
    from h3serve.api.server_config import ServerConfig, default_data_dir
    from h3serve.checkpoint.resolver import CheckpointError
    from h3serve.entrypoints.engine_args import engine_config_from_args
    from h3serve.media.mp4 import EncoderOptions, nvenc_refusal

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        model = model_dir(args.model_dir)
        engine_config = engine_config_from_args(args, model)
        server_config = ServerConfig(
            served_model_name=args.served_model_name or model.resolve().name,
            host=args.host,
            port=args.port,
            api_key=args.api_key,
            data_dir=args.data_dir or default_data_dir(),
            job_store=args.job_store,
            job_lease_s=args.job_lease,
            overlap_output=args.overlap_output,
            output_store=args.output_store,
            s3_endpoint_url=args.s3_endpoint_url,
            output_redirect=args.output_redirect,
            output_url_ttl_s=args.output_url_ttl,
            output_upload_attempts=args.output_upload_attempts,
            max_queue=args.max_queue,
            sync_timeout_s=args.sync_timeout,
            output_ttl_s=args.output_ttl,
            sweep_interval_s=args.ttl_sweep_interval,
            poll_after_ms=args.poll_after_ms,
            allow_private_media_urls=args.allow_private_media_urls,
            control_dir=args.control_dir,
            media_fetch_timeout_s=args.media_fetch_timeout,
            header_timeout_s=args.header_timeout,
            body_timeout_s=args.body_timeout,
            keep_alive_timeout_s=args.keep_alive_timeout,
            max_connections=args.max_connections,
            shutdown_grace_s=args.shutdown_grace,
            max_request_cost=args.max_request_cost,
            job_timeout_s=args.job_timeout,
            stall_timeout_s=args.stall_timeout,
            encoder_options=EncoderOptions(preset=args.x264_preset, crf=args.crf, audio_bitrate=args.audio_bitrate,
                                           encoder=args.video_encoder),
            realtime=engine_config.realtime_lora is not None,
            realtime_start_timeout_s=args.realtime_start_timeout,
            realtime_stall_timeout_s=args.realtime_stall_timeout,
            webhook_allow_hosts=tuple(args.webhook_allow_host),
            webhook_timeout_s=args.webhook_timeout,
            webhook_retry_initial_s=args.webhook_retry_initial,
            webhook_retry_horizon_s=args.webhook_retry_horizon,
        ).validate()
        nvenc_refusal(server_config.encoder_options, engine_config.decode_mode)
    except (ConfigError, CheckpointError, ValueError) as e:
        return fail(str(e))
    return run_server(engine_config, server_config)


def run_server(engine_config: EngineConfig, server_config: ServerConfig) -> int:
    """Start the rank processes (the model loads once), then serve until SIGINT/SIGTERM."""
    from h3serve.api.data_lock import DataDirBusy, DataDirLock
    from h3serve.parallel.rendezvous import Rendezvous

    try:
        rendezvous = Rendezvous.from_env()
    except ValueError as e:
        return fail(str(e), EXIT_ERROR)
    if not rendezvous.is_leader:  # another node serves HTTP; this one only hosts its ranks
        return _serve_follower(engine_config, rendezvous)
    if server_config.job_store is not None:  # a shared queue: every server of the database shares the data dir
        return _serve_leader(engine_config, server_config, rendezvous)
    lock = DataDirLock(server_config.data_dir)
    try:  # before the model loads: a second server on this data dir fails in a moment, not minutes
        lock.acquire()
    except (DataDirBusy, OSError) as e:
        return fail(f"--data-dir: {e}", EXIT_ERROR)
    try:
        return _serve_leader(engine_config, server_config, rendezvous)
    finally:
        lock.release()


def _open_storage(server_config: ServerConfig) -> tuple[JobStore, JobFiles]:
    """The job store and files. `OSError` (an unusable folder), `sqlite3.Error` (a broken or locked database),
    `psycopg.Error` (an unreachable PostgreSQL; `jobstore.database_errors`) or `RuntimeError` (a database from a newer
    h3serve) if the data dir or the database cannot hold them."""
    from h3serve.jobstore import open_job_store
    from h3serve.jobstore.job_files import JobFiles

    store = open_job_store(server_config.job_store or server_config.store_path)
    try:
        return store, JobFiles(server_config.jobs_dir)
    except BaseException:
        store.close()
        raise


def _open_outputs(server_config: ServerConfig, files: JobFiles) -> OutputStore:
    """The output store, checked: `ConfigError` (boto3 missing) or `OutputStoreUnavailable` (the bucket cannot be
    reached, does not exist, or refuses a write) say why the server cannot start."""
    from h3serve.output_store import open_output_store

    outputs = open_output_store(server_config.output_store, files, server_config.s3_endpoint_url)
    outputs.check()
    log.info("outputs go to %s", outputs.describe())
    return outputs


def _serve_leader(engine_config: EngineConfig, server_config: ServerConfig, rendezvous: Rendezvous) -> int:
    from h3serve.adapters.serving import catalog_for
    from h3serve.api.app import create_app
    from h3serve.api.http_server import build_server
    from h3serve.engine.executor import EngineError, Executor
    from h3serve.engine.jobs import JobManager
    from h3serve.engine.replicas import start_replicas
    from h3serve.extras import MissingExtra
    from h3serve.jobstore import database_errors
    from h3serve.output_store.interface import OutputStoreUnavailable

    if server_config.api_key is None and server_config.host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("serving on %s without --api-key: anyone who can reach it can submit jobs", server_config.host)
    try:  # before the engine too: a bad data dir should not cost a model load
        store, files = _open_storage(server_config)
    except (OSError, RuntimeError, MissingExtra, *database_errors()) as e:
        where = "--job-store" if server_config.job_store else f"--data-dir {server_config.data_dir}"
        return fail(f"{where}: {e}", EXIT_ERROR)
    try:  # a bucket that cannot be reached or written refuses the start, before the model loads
        outputs = _open_outputs(server_config, files)
    except (ConfigError, OutputStoreUnavailable) as e:
        store.close()
        return fail(f"--output-store: {e}", EXIT_USAGE if isinstance(e, ConfigError) else EXIT_ERROR)
    log.info("starting the engine: %s on %s", engine_config.model, engine_config.device)
    try:
        executors = start_replicas(engine_config, rendezvous, Executor)
    except (EngineError, ConfigError) as e:  # a flag the ranks' start-up check refused is a usage error
        store.close()
        return fail(str(e), EXIT_USAGE if isinstance(e, ConfigError) else EXIT_ERROR)
    manager = None
    try:
        manager = JobManager(
            executors,
            store,
            files,
            model_name=server_config.served_model_name,
            max_request_cost=server_config.max_request_cost,
            max_queue=server_config.max_queue,
            output_ttl_s=server_config.output_ttl_s or None,
            sweep_interval_s=server_config.sweep_interval_s,
            encoder_options=server_config.encoder_options,
            job_timeout_s=server_config.job_timeout_s,
            stall_timeout_s=server_config.stall_timeout_s,
            lease_s=server_config.job_lease_s,
            overlap_output=server_config.overlap_output,
            outputs=outputs,
            upload_attempts=server_config.output_upload_attempts,
        )
        app = create_app(server_config, manager, store, lora=catalog_for(engine_config), engine=engine_config)
        log.info("serving %r on http://%s:%d (data in %s, outputs in %s)", server_config.served_model_name,
                 server_config.host, server_config.port, server_config.data_dir, outputs.describe())
        build_server(app, server_config, log_level=logging.root.level).run()
    finally:
        shut_down(manager, executors, store)
    return 0


def shut_down(manager: JobManager | None, executors: Executor | list[Executor], store: JobStore) -> None:
    """Stop in the order that keeps every job: the runner is asked to stop (the app's lifespan did so and
    waited a while already), the ranks are closed (killing any still busy: the runner gets `EngineError` and
    puts its job back in the queue), the runner is joined, and only then is the store closed."""
    if manager is not None:
        manager.stop()
    for executor in executors if isinstance(executors, list) else [executors]:
        executor.close()
    if manager is not None and not manager.join(RUNNER_JOIN_S):
        log.warning("the job runner did not stop within %g s; its job may run again on the next start",
                    RUNNER_JOIN_S)
    store.close()


def _serve_follower(engine_config: EngineConfig, rendezvous: Rendezvous) -> int:
    from h3serve.engine.executor import EngineError, Executor

    try:
        executor = Executor(engine_config, rendezvous=rendezvous)
    except EngineError as e:
        return fail(str(e), EXIT_ERROR)
    log.info("follower node: serving ranks %s for the leader", executor.pids())
    try:
        executor.run_follower()
    finally:
        executor.close()
    return 0
