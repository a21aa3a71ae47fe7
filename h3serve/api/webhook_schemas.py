"""The webhook routes' bodies, field for field as the installed OpenAI SDK's types (openai.types.webhooks:
WebhookEndpoint, WebhookEndpointWithSecret, WebhookEndpointList, DeletedWebhookEndpoint, WebhookEndpointTestResult,
WebhookEventTypeList and the create / update / rotate_secret / test params), plus h3serve's view of a job's
deliveries (the web page shows it). A secret appears only in the answers to create and rotate_secret."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator

from h3serve.jobstore.webhook_records import DeliveryState, WebhookDelivery, WebhookEndpoint
from h3serve.rules import limits
from h3serve.rules.names import WEBHOOK_EVENT_TYPES

_EVENT_TYPES_SCHEMA = {"items": {"type": "string", "enum": list(WEBHOOK_EVENT_TYPES)}}
# A name: printable text, not blank. A URL: no space or control character (the guard judges the rest).
NAME_PATTERN = r"^[^\x00-\x1f\x7f]*[^\s\x00-\x1f\x7f][^\x00-\x1f\x7f]*$"
URL_PATTERN = r"^[^\x00-\x20\x7f]+$"
# Rules no schema can state, each a 400 with its code (tests/hostile/test_schema_fuzz.py accepts these and no other
# 400 for a schema-valid request).
WEBHOOK_RULES: dict[str, str] = {
    "invalid_url": "`url` must be https, its host must resolve, and only to public addresses (http, and any address, "
    "only to a host the operator allows with `serve --webhook-allow-host`)",
    "too_many_webhook_endpoints": f"an API key has at most {limits.MAX_WEBHOOK_ENDPOINTS} webhook endpoints",
    "webhook_test_failed": "`test` answers 400 when the receiver could not be reached (no status code to report)",
}
_RULES_TEXT = "Rules no schema can state (each a 400 naming its code): " + "; ".join(
    f"{code}: {text}" for code, text in WEBHOOK_RULES.items()) + "."


def _utf8(value: str) -> str:
    """Text a database can hold: no lone surrogate (JSON can carry one)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("must be valid UTF-8 text (it holds a lone surrogate)") from None
    return value


def check_event_types(values: list[str]) -> list[str]:
    """The event types as stored (each once, in h3serve's order); `ValueError` naming every one h3serve never
    sends."""
    unknown = [t for t in dict.fromkeys(values) if t not in WEBHOOK_EVENT_TYPES]
    if unknown:
        raise ValueError(f"h3serve sends only {', '.join(WEBHOOK_EVENT_TYPES)}; not {', '.join(map(repr, unknown))}")
    return [t for t in WEBHOOK_EVENT_TYPES if t in values]


Name = Annotated[str, Field(min_length=1, max_length=limits.MAX_WEBHOOK_NAME_CHARS, pattern=NAME_PATTERN),
                 AfterValidator(_utf8)]
URL = Annotated[str, Field(min_length=1, max_length=limits.MAX_WEBHOOK_URL_CHARS, pattern=URL_PATTERN),
                AfterValidator(_utf8)]
EventTypes = Annotated[list[str], Field(min_length=1, max_length=32, json_schema_extra=_EVENT_TYPES_SCHEMA),
                       AfterValidator(check_event_types)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", json_schema_extra={"description": _RULES_TEXT})


class WebhookEndpointCreateBody(_Body):
    """`client.webhooks.create(name=, url=, event_types=[...])`."""

    name: Name = Field(description="A human-readable name for the webhook endpoint.")
    url: URL = Field(description="The HTTPS URL that receives webhook deliveries (http only to a host the operator "
                     "allows with `serve --webhook-allow-host`).")
    event_types: EventTypes = Field(description="The event types that trigger deliveries to this endpoint.")


class WebhookEndpointUpdateBody(_Body):
    """`client.webhooks.update(id, name=, url=, event_types=)`: only the fields given change."""

    name: Name | None = Field(default=None, description="A new human-readable name for the webhook endpoint.")
    url: URL | None = Field(default=None, description="A new HTTPS URL that receives webhook deliveries.")
    event_types: EventTypes | None = Field(default=None, description="The complete set of event types that should "
                                           "trigger deliveries.")


class WebhookRotateSecretBody(_Body):
    """`client.webhooks.rotate_secret(id, keep_old_secret_active_for_24_hours=)`."""

    keep_old_secret_active_for_24_hours: bool = Field(
        default=False, description="Whether to keep the previous signing secret valid for 24 hours after rotation; "
        "false invalidates it at once.")


class WebhookTestBody(_Body):
    """`client.webhooks.test(id, event_type=)`."""

    event_type: str = Field(json_schema_extra={"enum": list(WEBHOOK_EVENT_TYPES)},
                            description="The event type to send as a sample delivery.")

    @field_validator("event_type")
    @classmethod
    def _event_type(cls, value: str) -> str:
        return check_event_types([value])[0]


class WebhookEndpointObject(BaseModel):
    """The SDK's `WebhookEndpoint`."""

    id: str
    object: Literal["webhook_endpoint"] = "webhook_endpoint"
    name: str
    url: str
    event_types: list[str]
    created_at: int
    updated_at: int | None
    signing_secret_hint: str | None

    @classmethod
    def of(cls, endpoint: WebhookEndpoint) -> WebhookEndpointObject:
        return cls(id=endpoint.id, name=endpoint.name, url=endpoint.url, event_types=list(endpoint.event_types),
                   created_at=endpoint.created_at, updated_at=endpoint.updated_at,
                   signing_secret_hint=endpoint.secret_hint)


class WebhookEndpointWithSecretObject(WebhookEndpointObject):
    """The SDK's `WebhookEndpointWithSecret`: the answer to create and rotate_secret, the only time the secret is
    shown."""

    signing_secret: str

    @classmethod
    def with_secret(cls, endpoint: WebhookEndpoint) -> WebhookEndpointWithSecretObject:
        return cls(**WebhookEndpointObject.of(endpoint).model_dump(), signing_secret=endpoint.secret)


class WebhookEndpointListObject(BaseModel):
    """The SDK's `WebhookEndpointList` (a cursor page, newest first)."""

    object: Literal["list"] = "list"
    data: list[WebhookEndpointObject]
    first_id: str | None
    last_id: str | None
    has_more: bool


class WebhookEndpointDeletedObject(BaseModel):
    """The SDK's `DeletedWebhookEndpoint`."""

    id: str
    object: Literal["webhook_endpoint.deleted"] = "webhook_endpoint.deleted"
    deleted: bool = True


class WebhookTestResultObject(BaseModel):
    """The SDK's `WebhookEndpointTestResult`: the receiver answered (`status_code` says how)."""

    object: Literal["webhook_endpoint.test"] = "webhook_endpoint.test"
    webhook_endpoint_id: str
    event_type: str
    status_code: int
    success: Literal[True] = True


class WebhookEventTypesObject(BaseModel):
    """The SDK's `WebhookEventTypeList`."""

    object: Literal["list"] = "list"
    data: list[str]


class WebhookDeliveryObject(BaseModel):
    """h3serve: one delivery of a job's event to one endpoint, as the web page shows it. `id` is the webhook-id every
    attempt carries."""

    id: str
    object: Literal["webhook_delivery"] = "webhook_delivery"
    event_id: str
    event_type: str
    video_id: str
    webhook_endpoint_id: str
    state: DeliveryState
    attempts: int
    created_at: int
    next_attempt_at: int | None  # pending only
    last_attempt_at: int | None
    last_status_code: int | None
    last_error: str | None
    delivered_at: int | None

    @classmethod
    def of(cls, delivery: WebhookDelivery) -> WebhookDeliveryObject:
        def whole(t: float | None) -> int | None:
            return None if t is None else int(t)

        return cls(
            id=delivery.id, event_id=delivery.event_id, event_type=delivery.event_type, video_id=delivery.video_id,
            webhook_endpoint_id=delivery.endpoint_id, state=delivery.state, attempts=delivery.attempts,
            created_at=delivery.created_at,
            next_attempt_at=whole(delivery.next_attempt_at) if delivery.state == "pending" else None,
            last_attempt_at=whole(delivery.last_attempt_at), last_status_code=delivery.last_status_code,
            last_error=delivery.last_error, delivered_at=whole(delivery.delivered_at),
        )


class WebhookDeliveryListObject(BaseModel):
    object: Literal["list"] = "list"
    data: list[WebhookDeliveryObject]
