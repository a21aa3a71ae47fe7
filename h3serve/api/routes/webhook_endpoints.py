"""The webhook routes, as the OpenAI SDK calls them (`client.webhooks.*`, docs/webhooks.md): endpoints created,
listed, retrieved, updated, rotated, tested and deleted under the API key that made them, the event types, and
h3serve's view of one job's deliveries.

A URL is checked when it is given (the outbound guard, h3serve/engine/outbox/sender.py), as every delivery checks it
again. `test` sends one real signed delivery now and answers with the receiver's status code; it is not written to
the outbox (nothing retries it)."""

from __future__ import annotations

import asyncio
import time
from typing import Annotated

from fastapi import APIRouter, Body, Depends, Query
from fastapi import Path as PathParam
from starlette.concurrency import run_in_threadpool

from h3serve.api.auth import key_scope
from h3serve.api.context import ServerContext, get_context
from h3serve.api.error_envelope import APIError, bad_request
from h3serve.api.openapi import error_responses
from h3serve.api.webhook_schemas import (
    WebhookDeliveryListObject,
    WebhookDeliveryObject,
    WebhookEndpointCreateBody,
    WebhookEndpointDeletedObject,
    WebhookEndpointListObject,
    WebhookEndpointObject,
    WebhookEndpointUpdateBody,
    WebhookEndpointWithSecretObject,
    WebhookEventTypesObject,
    WebhookRotateSecretBody,
    WebhookTestBody,
    WebhookTestResultObject,
)
from h3serve.engine.outbox.sender import WebhookURLRefused
from h3serve.jobstore.webhook_records import (
    WebhookEndpoint,
    event_payload,
    new_delivery_id,
    new_endpoint_id,
    new_event_id,
    new_secret,
    secret_hint,
)
from h3serve.rules import limits
from h3serve.rules.names import WEBHOOK_EVENT_TYPES

router = APIRouter(tags=["webhooks"])
Context = Annotated[ServerContext, Depends(get_context)]
EndpointId = Annotated[str, PathParam(description="the webhook endpoint's id")]
URL_CHECK_TIMEOUT_S = 5.0  # resolving a new URL's host when it is given


def _scope(ctx: ServerContext) -> str:
    return key_scope(ctx.config.api_key)


def _not_found(endpoint_id: str) -> APIError:
    return APIError(404, f"Webhook endpoint with id '{endpoint_id}' not found.", "webhook_endpoint_not_found",
                    "webhook_endpoint_id")


def _found(endpoint: WebhookEndpoint | None, endpoint_id: str) -> WebhookEndpoint:
    if endpoint is None:
        raise _not_found(endpoint_id)
    return endpoint


async def _checked_url(ctx: ServerContext, url: str) -> str:
    """`url` if deliveries may go there (https, a public address after DNS, or an allowed host); else 400."""
    try:
        async with asyncio.timeout(URL_CHECK_TIMEOUT_S):
            await ctx.outbox.sender.guard.check(url)
    except WebhookURLRefused as e:
        raise bad_request(f"url: {e}", "url", "invalid_url") from None
    except TimeoutError:
        raise bad_request(f"url: its host did not resolve within {URL_CHECK_TIMEOUT_S:g} s", "url",
                          "invalid_url") from None
    return url


@router.post("/webhook_endpoints", response_model=WebhookEndpointWithSecretObject,
             summary="Create a webhook endpoint (the answer shows its signing secret, once)",
             responses=error_responses(400, 401))
async def create_webhook_endpoint(body: WebhookEndpointCreateBody, ctx: Context) -> WebhookEndpointWithSecretObject:
    url = await _checked_url(ctx, body.url)
    now = int(time.time())
    secret = new_secret()
    endpoint = WebhookEndpoint(
        id=new_endpoint_id(), key_scope=_scope(ctx), name=body.name, url=url, event_types=tuple(body.event_types),
        created_at=now, updated_at=now, secret=secret, secret_hint=secret_hint(secret),
    )
    stored = await run_in_threadpool(ctx.store.insert_endpoint, endpoint, limits.MAX_WEBHOOK_ENDPOINTS)
    if stored is None:
        raise bad_request(f"this API key has {limits.MAX_WEBHOOK_ENDPOINTS} webhook endpoints already, the most it "
                          "may have; delete one first", None, "too_many_webhook_endpoints")
    return WebhookEndpointWithSecretObject.with_secret(stored)


@router.get("/webhook_endpoints", response_model=WebhookEndpointListObject,
            summary="List webhook endpoints, newest first", responses=error_responses(400, 401))
def list_webhook_endpoints(
    ctx: Context,
    after: Annotated[str | None, Query(description="id of the last endpoint of the previous page")] = None,
    limit: Annotated[int, Query(ge=0, le=100, description="endpoints per page (default 20)")] = 20,
) -> WebhookEndpointListObject:
    endpoints, has_more = ctx.store.page_endpoints(_scope(ctx), after, limit)
    data = [WebhookEndpointObject.of(e) for e in endpoints]
    return WebhookEndpointListObject(data=data, first_id=data[0].id if data else None,
                                     last_id=data[-1].id if data else None, has_more=has_more)


@router.get("/webhook_endpoints/{webhook_endpoint_id}", response_model=WebhookEndpointObject,
            summary="Retrieve a webhook endpoint", responses=error_responses(401, 404))
def retrieve_webhook_endpoint(webhook_endpoint_id: EndpointId, ctx: Context) -> WebhookEndpointObject:
    return WebhookEndpointObject.of(_found(ctx.store.get_endpoint(_scope(ctx), webhook_endpoint_id),
                                           webhook_endpoint_id))


@router.post("/webhook_endpoints/{webhook_endpoint_id}", response_model=WebhookEndpointObject,
             summary="Update a webhook endpoint's name, URL or event types", responses=error_responses(400, 401, 404))
async def update_webhook_endpoint(webhook_endpoint_id: EndpointId, body: WebhookEndpointUpdateBody,
                                  ctx: Context) -> WebhookEndpointObject:
    scope = _scope(ctx)
    _found(await run_in_threadpool(ctx.store.get_endpoint, scope, webhook_endpoint_id), webhook_endpoint_id)
    url = None if body.url is None else await _checked_url(ctx, body.url)
    types = None if body.event_types is None else tuple(body.event_types)
    updated = await run_in_threadpool(ctx.store.update_endpoint, scope, webhook_endpoint_id, int(time.time()),
                                      body.name, url, types)
    return WebhookEndpointObject.of(_found(updated, webhook_endpoint_id))


@router.delete("/webhook_endpoints/{webhook_endpoint_id}", response_model=WebhookEndpointDeletedObject,
               summary="Delete a webhook endpoint (its pending deliveries are dropped)",
               responses=error_responses(401, 404))
def delete_webhook_endpoint(webhook_endpoint_id: EndpointId, ctx: Context) -> WebhookEndpointDeletedObject:
    if not ctx.store.delete_endpoint(_scope(ctx), webhook_endpoint_id):
        raise _not_found(webhook_endpoint_id)
    return WebhookEndpointDeletedObject(id=webhook_endpoint_id)


@router.post("/webhook_endpoints/{webhook_endpoint_id}/rotate_secret", response_model=WebhookEndpointWithSecretObject,
             summary="Rotate the signing secret (the old one stays valid 24 h if asked)",
             responses=error_responses(400, 401, 404))
def rotate_webhook_secret(
    webhook_endpoint_id: EndpointId, ctx: Context,
    body: Annotated[WebhookRotateSecretBody | None, Body()] = None,
) -> WebhookEndpointWithSecretObject:
    keep = body is not None and body.keep_old_secret_active_for_24_hours
    now = int(time.time())
    secret = new_secret()
    rotated = ctx.store.rotate_endpoint_secret(_scope(ctx), webhook_endpoint_id, secret, secret_hint(secret), now,
                                               now + limits.WEBHOOK_SECRET_GRACE_S if keep else None)
    return WebhookEndpointWithSecretObject.with_secret(_found(rotated, webhook_endpoint_id))


@router.post("/webhook_endpoints/{webhook_endpoint_id}/test", response_model=WebhookTestResultObject,
             summary="Send a real signed sample event to the endpoint now", responses=error_responses(400, 401, 404))
async def test_webhook_endpoint(webhook_endpoint_id: EndpointId, body: WebhookTestBody,
                                ctx: Context) -> WebhookTestResultObject:
    endpoint = _found(await run_in_threadpool(ctx.store.get_endpoint, _scope(ctx), webhook_endpoint_id),
                      webhook_endpoint_id)
    now = int(time.time())
    sample_video = f"video_test_{new_event_id()[4:28]}"  # a sample id: no job of this server has it
    payload = event_payload(new_event_id(), body.event_type, sample_video, now)
    result = await ctx.outbox.sender.send(endpoint.url, new_delivery_id(), payload, endpoint.signing_secrets(now))
    if result.status_code is None:  # never answered (refused, unreachable, timed out): nothing to report
        raise APIError(400, f"The test delivery to the endpoint failed: {result.error}.", "webhook_test_failed",
                       "webhook_endpoint_id")
    return WebhookTestResultObject(webhook_endpoint_id=endpoint.id, event_type=body.event_type,
                                   status_code=result.status_code)


@router.get("/webhook_event_types", response_model=WebhookEventTypesObject,
            summary="The webhook event types this server sends", responses=error_responses(401))
def list_webhook_event_types() -> WebhookEventTypesObject:
    return WebhookEventTypesObject(data=list(WEBHOOK_EVENT_TYPES))


@router.get("/videos/{video_id}/webhook_deliveries", response_model=WebhookDeliveryListObject,
            summary="h3serve: the webhook deliveries of a job's event (state and attempts, per endpoint)",
            responses=error_responses(401))
def list_video_webhook_deliveries(video_id: str, ctx: Context) -> WebhookDeliveryListObject:
    deliveries = ctx.store.deliveries_for_video(_scope(ctx), video_id)
    return WebhookDeliveryListObject(data=[WebhookDeliveryObject.of(d) for d in deliveries])
