"""Health, model list and Prometheus metrics."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, PlainTextResponse

from h3serve.api.context import ServerContext, get_context
from h3serve.api.openapi import error_responses
from h3serve.api.schemas import Model, ModelList

router = APIRouter(tags=["system"])  # no API key: probes and scrapers reach these
v1_router = APIRouter(tags=["models"])
Context = Annotated[ServerContext, Depends(get_context)]
PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"


@router.get("/health", summary="200 while the engine and the job runner are alive and not stuck, else 503")
async def health(request: Request) -> JSONResponse:
    # Async on purpose: it answers from the event loop even if every worker thread were busy.
    reason = get_context(request).manager.unhealthy_reason()
    if reason is None:
        return JSONResponse({"status": "healthy"})
    return JSONResponse({"status": "unhealthy", "reason": reason}, 503)


@router.get("/metrics", summary="Prometheus metrics", response_class=PlainTextResponse)
def metrics(ctx: Context) -> PlainTextResponse:
    text = ctx.metrics.render(ctx.manager, ctx.store.count_by_status())
    return PlainTextResponse(text, media_type=PROMETHEUS_TEXT)


@v1_router.get("/models", response_model=ModelList, summary="The served model", responses=error_responses(401))
def list_models(ctx: Context) -> ModelList:
    return ModelList(data=[Model(id=ctx.config.served_model_name, created=ctx.started_at)])
