"""Standard Webhooks signatures, as OpenAI's SDK verifies them (`client.webhooks.verify_signature`): HMAC-SHA256
over `webhook-id.webhook-timestamp.body` with the secret's bytes (base64 after `whsec_`), base64-encoded and sent as
`v1,<signature>`; several signatures (the current secret's and, in its grace period, the previous one's) are
separated by spaces, and a receiver accepts the delivery if any matches."""

from __future__ import annotations

import base64
import hashlib
import hmac
from collections.abc import Sequence

from h3serve.jobstore.webhook_records import SECRET_PREFIX


def secret_key(secret: str) -> bytes:
    """The HMAC key a secret stands for."""
    if secret.startswith(SECRET_PREFIX):
        return base64.b64decode(secret[len(SECRET_PREFIX):])
    return secret.encode()


def signature(secret: str, webhook_id: str, timestamp: int, payload: str) -> str:
    mac = hmac.new(secret_key(secret), f"{webhook_id}.{timestamp}.{payload}".encode(), hashlib.sha256)
    return "v1," + base64.b64encode(mac.digest()).decode("ascii")


def signed_headers(webhook_id: str, timestamp: int, payload: str, secrets: Sequence[str]) -> dict[str, str]:
    """The three Standard Webhooks headers of one attempt."""
    return {
        "webhook-id": webhook_id,
        "webhook-timestamp": str(timestamp),
        "webhook-signature": " ".join(signature(s, webhook_id, timestamp, payload) for s in secrets),
    }
