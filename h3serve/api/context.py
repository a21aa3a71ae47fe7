"""What every route needs, built once by the app factory and reached through `request.app.state`."""

from __future__ import annotations

from dataclasses import dataclass

from fastapi import Request

from h3serve.adapters.catalog import LoraCatalog
from h3serve.api.prometheus import Metrics
from h3serve.api.server_config import ServerConfig
from h3serve.api.sync_line import SyncLine
from h3serve.api.url_fetch import MediaFetcher
from h3serve.config.engine_config import EngineConfig
from h3serve.engine.jobs import JobManager
from h3serve.engine.outbox.outbox_worker import OutboxWorker
from h3serve.jobstore.store import JobStore


@dataclass(frozen=True)
class ServerContext:
    config: ServerConfig
    manager: JobManager
    store: JobStore
    fetcher: MediaFetcher
    metrics: Metrics
    started_at: int
    sync_line: SyncLine  # sync requests waiting for a queue slot (h3serve/api/sync_line.py)
    outbox: OutboxWorker  # sends the webhook deliveries (its sender also serves the `test` route)
    lora: LoraCatalog | None = None  # the adapters this server offers (--lora-path / --lora-dir)
    engine: EngineConfig | None = None  # the engine flags, for the model card's capabilities


def get_context(request: Request) -> ServerContext:
    context: ServerContext = request.app.state.context
    return context
