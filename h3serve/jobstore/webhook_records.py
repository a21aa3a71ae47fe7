"""Webhook endpoints and their deliveries as stored: the one definition the store, the delivery worker and the API
read (docs/webhooks.md).

An endpoint belongs to the API key that made it (`key_scope`, a digest of the key; "" when keys are off). A
delivery is one event for one endpoint: its `id` is the `webhook-id` header, the same on every attempt, and its
`payload` the exact body every attempt sends, so a receiver can dedupe by the id and the signature always covers the
same bytes. Signing secrets are kept only where signing needs them (the current one, and the previous one until its
grace period ends) and never printed: their fields are left out of `repr`.
"""

from __future__ import annotations

import base64
import json
import secrets
from dataclasses import dataclass, field
from typing import Literal, get_args

from h3serve.jobstore.records import JobStatus

DeliveryState = Literal["pending", "delivered", "failed"]
DELIVERY_STATES: tuple[DeliveryState, ...] = get_args(DeliveryState)
SECRET_PREFIX = "whsec_"  # the Standard Webhooks form the SDK's verify_signature decodes (base64 after the prefix)
SECRET_BYTES = 32

# The event a finished job sends, by its final status (a deleted unfinished job sends video.failed too).
VIDEO_EVENTS: dict[JobStatus, str] = {"completed": "video.completed", "failed": "video.failed"}


def new_endpoint_id() -> str:
    return f"we_{secrets.token_hex(16)}"


def new_event_id() -> str:
    return f"evt_{secrets.token_hex(16)}"


def new_delivery_id() -> str:
    """A delivery's `webhook-id`."""
    return f"wh_{secrets.token_hex(16)}"


def new_secret() -> str:
    return SECRET_PREFIX + base64.b64encode(secrets.token_bytes(SECRET_BYTES)).decode("ascii")


def secret_hint(secret: str) -> str:
    """What a client may see of a secret after it was shown once: its prefix and last four characters."""
    return f"{SECRET_PREFIX}...{secret[-4:]}"


def event_payload(event_id: str, event_type: str, video_id: str, created_at: int) -> str:
    """The body of a video event, shaped as the SDK's webhook events: object, id, type, created_at, data.id."""
    body = {"object": "event", "id": event_id, "type": event_type, "created_at": created_at, "data": {"id": video_id}}
    return json.dumps(body, separators=(",", ":"))


@dataclass(frozen=True)
class WebhookEndpoint:
    """One endpoint. `updated_at` moves only when its configuration or secret changes."""

    id: str
    key_scope: str
    name: str
    url: str
    event_types: tuple[str, ...]
    created_at: int
    updated_at: int
    secret: str = field(repr=False)
    secret_hint: str
    previous_secret: str | None = field(default=None, repr=False)  # valid until previous_secret_expires_at
    previous_secret_expires_at: int | None = None
    seq: int = 0

    def signing_secrets(self, now: float) -> tuple[str, ...]:
        """The secrets a delivery at `now` is signed with: the current one, and the previous one in its grace."""
        previous = self.previous_secret
        expires = self.previous_secret_expires_at
        if previous is not None and expires is not None and now < expires:
            return self.secret, previous
        return (self.secret,)


@dataclass(frozen=True)
class WebhookDelivery:
    """One event for one endpoint, in the outbox until delivered or given up. `owner` and `lease_expires_at` name
    the server sending it now (a dead server's lease runs out and another takes the delivery over)."""

    id: str  # the webhook-id header: one per delivery, the same on every attempt
    event_id: str
    event_type: str
    video_id: str
    endpoint_id: str
    key_scope: str
    payload: str
    created_at: int  # the event's time: its horizon counts from here
    state: DeliveryState = "pending"
    attempts: int = 0
    next_attempt_at: float = 0.0
    owner: str | None = None
    lease_expires_at: float | None = None
    last_attempt_at: float | None = None
    last_status_code: int | None = None
    last_error: str | None = None
    delivered_at: float | None = None
    seq: int = 0
