"""Webhook deliveries from the durable outbox (docs/webhooks.md), on the parent side: no torch, never on the
request path or a rank. `OutboxWorker` (outbox_worker.py) claims due deliveries from the job store under a lease and
sends them with `WebhookSender` (sender.py: the URL guard, signed Standard Webhooks headers, short timeouts, a small
response bound), retrying on `RetryPolicy` (retry.py)."""
