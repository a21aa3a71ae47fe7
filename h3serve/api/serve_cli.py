"""`h3serve serve [MODEL_DIR]`: start the engine, then the OpenAI-compatible HTTP API on uvicorn."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from h3serve.api.config import ServerConfig
    from h3serve.config import EngineConfig


def register(sub: argparse._SubParsersAction) -> None:
    from h3serve.engine.args import add_engine_args

    p = sub.add_parser("serve", help="serve the OpenAI-compatible /v1/videos API")
    p.add_argument("model_dir", nargs="?", metavar="MODEL_DIR",
                   help="checkpoint folder (default: the tiny checkpoint, built on first use)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=os.environ.get("H3SERVE_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1 routes (default: $H3SERVE_API_KEY)")
    p.add_argument("--data-dir", type=Path,
                   help="jobs, inputs and outputs (default: $H3SERVE_DATA_DIR, else ~/.local/share/h3serve)")
    p.add_argument("--served-model-name", help="the model id clients see (default: the checkpoint folder name)")
    p.add_argument("--max-queue", type=int, default=16, help="queued jobs before 429 (default 16)")
    p.add_argument("--sync-timeout", type=float, default=600.0, help="/v1/videos/sync timeout in s (default 600)")
    p.add_argument("--output-ttl", type=float, default=86_400.0,
                   help="seconds a finished job's files are kept (default 86400; 0 keeps them)")
    p.add_argument("--ttl-sweep-interval", type=float, default=60.0, help="seconds between expiry sweeps")
    p.add_argument("--poll-after-ms", type=int, default=1000, help="openai-poll-after-ms on retrieve (default 1000)")
    p.add_argument("--allow-private-media-urls", action="store_true",
                   help="let media URLs reach loopback, private and link-local addresses")
    p.add_argument("--media-fetch-timeout", type=float, default=30.0, help="seconds per media URL (default 30)")
    p.add_argument("--x264-preset", default="medium", help="x264 preset (default medium)")
    p.add_argument("--crf", type=int, default=18, help="x264 constant rate factor (default 18)")
    p.add_argument("--audio-bitrate", type=int, default=192_000, help="AAC bitrate in bit/s (default 192000)")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    add_engine_args(p)  # device, parallel layout (--num-gpus, -tp, --usp, --ring, ...), vLLM-Omni recipe flags
    p.set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    from h3serve.api.config import ServerConfig, default_data_dir
    from h3serve.checkpoint import CheckpointError
    from h3serve.cli import _fail, _model_dir
    from h3serve.config import ConfigError
    from h3serve.engine.args import engine_config_from_args
    from h3serve.media.mp4 import EncoderOptions

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        model = _model_dir(args.model_dir)
        engine_config = engine_config_from_args(args, model)
        server_config = ServerConfig(
            served_model_name=args.served_model_name or model.resolve().name,
            host=args.host,
            port=args.port,
            api_key=args.api_key,
            data_dir=args.data_dir or default_data_dir(),
            max_queue=args.max_queue,
            sync_timeout_s=args.sync_timeout,
            output_ttl_s=args.output_ttl,
            sweep_interval_s=args.ttl_sweep_interval,
            poll_after_ms=args.poll_after_ms,
            allow_private_media_urls=args.allow_private_media_urls,
            media_fetch_timeout_s=args.media_fetch_timeout,
            encoder_options=EncoderOptions(preset=args.x264_preset, crf=args.crf, audio_bitrate=args.audio_bitrate),
        ).validate()
    except (ConfigError, CheckpointError) as e:
        return _fail(str(e))
    return run_server(engine_config, server_config)


def run_server(engine_config: EngineConfig, server_config: ServerConfig) -> int:
    """Start the rank processes (the model loads once), then serve until SIGINT/SIGTERM."""
    import uvicorn

    from h3serve.api.app import create_app
    from h3serve.api.store import SQLiteJobStore
    from h3serve.engine.executor import EngineError, Executor
    from h3serve.engine.jobs import JobManager
    from h3serve.engine.storage import JobFiles

    log = logging.getLogger("h3serve.serve")
    if server_config.api_key is None and server_config.host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("serving on %s without --api-key: anyone who can reach it can submit jobs", server_config.host)
    log.info("starting the engine: %s on %s", engine_config.model, engine_config.device)
    try:
        executor = Executor(engine_config)
    except EngineError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if not executor.rendezvous.is_leader:  # another node serves HTTP; this one only hosts its ranks
        log.info("follower node: serving ranks %s for the leader", executor.pids())
        try:
            executor.run_follower()
        finally:
            executor.close()
        return 0
    store = SQLiteJobStore(server_config.store_path)
    try:
        manager = JobManager(
            executor,
            store,
            JobFiles(server_config.jobs_dir),
            max_queue=server_config.max_queue,
            output_ttl_s=server_config.output_ttl_s or None,
            sweep_interval_s=server_config.sweep_interval_s,
            encoder_options=server_config.encoder_options,
        )
        app = create_app(server_config, manager, store)
        log.info("serving %r on http://%s:%d (data in %s)", server_config.served_model_name, server_config.host,
                 server_config.port, server_config.data_dir)
        uvicorn.run(app, host=server_config.host, port=server_config.port, log_level=logging.root.level,
                    timeout_graceful_shutdown=10)
    finally:
        executor.close()
        store.close()
    return 0
