"""Health, model list and Prometheus metrics."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, PlainTextResponse

from h3serve.api.context import ServerContext, get_context
from h3serve.api.model_card import capabilities
from h3serve.api.openapi import error_responses
from h3serve.api.schemas import Model, ModelList

router = APIRouter(tags=["system"])  # no API key: probes and scrapers reach these
v1_router = APIRouter(tags=["models"])
Context = Annotated[ServerContext, Depends(get_context)]
PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"


@router.get("/health", summary="200 while an engine replica and its job runner are alive and not stuck, else 503")
async def health(request: Request) -> JSONResponse:
    # Async on purpose: it answers from the event loop even if every worker thread were busy.
    manager = get_context(request).manager
    reason = manager.unhealthy_reason()
    body: dict[str, Any] = {"status": "healthy"} if reason is None else {"status": "unhealthy", "reason": reason}
    replicas = manager.replicas()
    if len(replicas) > 1:  # data parallelism: each replica's own state
        body["replicas"] = [
            {"replica": r.index, "healthy": r.problem is None, "busy": r.busy, "jobs_served": r.jobs_served,
             **({"reason": r.problem} if r.problem else {})}
            for r in replicas
        ]
    return JSONResponse(body, 200 if reason is None else 503)


@router.get("/metrics", summary="Prometheus metrics", response_class=PlainTextResponse)
def metrics(ctx: Context) -> PlainTextResponse:
    text = ctx.metrics.render(ctx.manager, ctx.store.count_by_status(), ctx.store.count_deliveries_by_state())
    return PlainTextResponse(text, media_type=PROMETHEUS_TEXT)


@v1_router.get("/models", response_model=ModelList, summary="The served model", responses=error_responses(401))
def list_models(ctx: Context) -> ModelList:
    name = ctx.config.served_model_name
    adapters = [] if ctx.lora is None else ctx.lora.models(name, ctx.started_at)
    served = capabilities(ctx.engine, ctx.manager.defaults, ctx.manager.tasks)
    return ModelList(data=[Model(id=name, created=ctx.started_at, capabilities=served),
                           *(Model(**card) for card in adapters)])
