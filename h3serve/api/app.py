"""The FastAPI app factory: routes (WS /v1/realtime/video among them), the API key on /v1, the body cap, the error
envelope, the job lifecycle and the webhook delivery worker's."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Depends, FastAPI
from starlette.concurrency import run_in_threadpool
from starlette.types import ASGIApp

import h3serve
from h3serve.adapters.catalog import LoraCatalog
from h3serve.api.auth import bearer_auth
from h3serve.api.body_limit import BodySizeLimit
from h3serve.api.context import ServerContext
from h3serve.api.error_envelope import install_error_handlers
from h3serve.api.last_resort import LastResort
from h3serve.api.openapi import exact_request_bodies
from h3serve.api.prometheus import Metrics
from h3serve.api.realtime import route as realtime
from h3serve.api.routes import system, videos, web, webhook_endpoints
from h3serve.api.server_config import ServerConfig
from h3serve.api.sync_line import SyncLine
from h3serve.api.url_fetch import MediaFetcher
from h3serve.config.engine_config import EngineConfig
from h3serve.engine.jobs import JobManager
from h3serve.engine.outbox.outbox_worker import OutboxWorker
from h3serve.engine.outbox.retry import RetryPolicy
from h3serve.engine.outbox.sender import WebhookSender, WebhookURLGuard
from h3serve.jobstore.store import JobStore


class H3App(FastAPI):
    """FastAPI with `LastResort` outside all of its middleware: no path answers uvicorn's plain-text 500; and an
    OpenAPI document whose request bodies are the schemas exactly as written (integer bounds stay integers)."""

    def build_middleware_stack(self) -> ASGIApp:
        return LastResort(super().build_middleware_stack())

    def openapi(self) -> dict[str, Any]:
        if self.openapi_schema is None:
            self.openapi_schema = exact_request_bodies(super().openapi(), self.routes)
        return self.openapi_schema


def create_app(
    config: ServerConfig,
    manager: JobManager,
    store: JobStore,
    fetcher: MediaFetcher | None = None,
    lora: LoraCatalog | None = None,
    engine: EngineConfig | None = None,
) -> FastAPI:
    """The app serving `manager`'s jobs. Its lifespan starts the manager (recovering stored jobs) and closes it."""
    metrics = Metrics()
    manager.add_listener(metrics.on_job_finished)
    manager.add_start_listener(metrics.on_job_started)
    manager.add_upload_listener(metrics.on_upload)
    outbox = webhook_outbox(config, manager, store, metrics)
    manager.add_listener(outbox.wake)  # a job's event is in the outbox once it finished: send it now
    context = ServerContext(
        config=config,
        manager=manager,
        store=store,
        fetcher=fetcher or MediaFetcher(config.media_fetch_timeout_s, config.allow_private_media_urls),
        metrics=metrics,
        started_at=int(time.time()),
        lora=lora,
        engine=engine,
        sync_line=SyncLine(config.max_queue),
        outbox=outbox,
    )

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await run_in_threadpool(manager.start)
        await run_in_threadpool(outbox.start)
        try:
            yield
        finally:
            await run_in_threadpool(outbox.stop)
            await run_in_threadpool(manager.close)

    app = H3App(
        title="h3serve",
        version=h3serve.__version__,
        summary="OpenAI-compatible video API for MiniMax-H3 (joint video + audio)",
        lifespan=lifespan,
    )
    app.state.context = context
    install_error_handlers(app)
    app.add_middleware(BodySizeLimit, max_bytes=config.max_body_bytes)

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(bearer_auth(config.api_key))])
    v1.include_router(videos.router)
    v1.include_router(system.v1_router)
    v1.include_router(webhook_endpoints.router)
    app.include_router(v1)
    app.include_router(realtime.router)  # checks the API key at the upgrade itself
    app.include_router(system.router)
    app.include_router(web.router)
    return app


def webhook_outbox(config: ServerConfig, manager: JobManager, store: JobStore, metrics: Metrics) -> OutboxWorker:
    """The server's webhook delivery worker, under the manager's lease name (docs/webhooks.md)."""
    sender = WebhookSender(WebhookURLGuard(config.webhook_allowed), timeout_s=config.webhook_timeout_s)
    retry = RetryPolicy(initial_s=config.webhook_retry_initial_s, horizon_s=config.webhook_retry_horizon_s)
    return OutboxWorker(store, sender, manager.owner, config.webhook_lease_s, retry=retry,
                        poll_s=config.webhook_poll_s, observer=metrics)
