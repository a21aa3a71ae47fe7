"""`h3serve webhooks list|create|delete|test`: manage a running server's webhook endpoints (docs/webhooks.md).

An operator's front door to the same routes the OpenAI SDK calls (`/v1/webhook_endpoints`): the server checks every
URL with its outbound guard and its `--webhook-allow-host` list, keeps the secrets, and sends the test delivery. The
API key comes from `--api-key` or `$H3SERVE_API_KEY` (endpoints belong to the key that made them); a secret is
printed once, by `create`."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any
from urllib.parse import quote

import httpx

from h3serve.entrypoints.cli_util import EXIT_ERROR, fail
from h3serve.rules.names import WEBHOOK_EVENT_TYPES

DEFAULT_URL = "http://127.0.0.1:8000"
TIMEOUT_S = 60.0  # a test delivery waits for the receiver (the server bounds it with --webhook-timeout)


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("webhooks", help="list, create, delete or test a running server's webhook endpoints")
    p.add_argument("--server", default=os.environ.get("H3SERVE_URL", DEFAULT_URL),
                   help="the server's base URL (default: $H3SERVE_URL, else %(default)s)")
    p.add_argument("--api-key", default=os.environ.get("H3SERVE_API_KEY"),
                   help="the server's --api-key (default: $H3SERVE_API_KEY); endpoints belong to the key")
    p.add_argument("--json", action="store_true", help="print the server's JSON answers as they are")
    actions = p.add_subparsers(dest="action", required=True)
    listing = actions.add_parser("list", help="the endpoints, newest first")
    listing.add_argument("--limit", type=int, default=100, help="at most this many (default %(default)s)")
    create = actions.add_parser("create", help="a new endpoint; prints its signing secret, once")
    create.add_argument("--name", required=True)
    create.add_argument("--url", required=True, help="https (http only to a host the server allows)")
    create.add_argument("--event-type", action="append", dest="event_types", choices=WEBHOOK_EVENT_TYPES,
                        help="repeatable (default: every one)")
    delete = actions.add_parser("delete", help="remove an endpoint (its pending deliveries are dropped)")
    delete.add_argument("endpoint_id")
    test = actions.add_parser("test", help="send a real signed sample event to an endpoint now")
    test.add_argument("endpoint_id")
    test.add_argument("--event-type", default=WEBHOOK_EVENT_TYPES[0], choices=WEBHOOK_EVENT_TYPES)
    p.set_defaults(func=cmd_webhooks)


def _request(args: argparse.Namespace, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
    """The server's JSON answer; `RuntimeError` with the server's own message on an error answer."""
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    with httpx.Client(base_url=args.server.rstrip("/"), headers=headers, timeout=TIMEOUT_S, trust_env=False) as c:
        response = c.request(method, f"/v1{path}", json=body)
    try:
        answer = response.json()
    except ValueError:
        answer = None
    if response.status_code >= 400:
        error = answer.get("error", {}) if isinstance(answer, dict) else {}
        raise RuntimeError(f"HTTP {response.status_code}: {error.get('message') or response.text[:200]}")
    return answer


def _endpoint_line(endpoint: dict[str, Any]) -> str:
    types = ",".join(endpoint["event_types"])
    return f"{endpoint['id']}  {endpoint['name']!r}  {endpoint['url']}  [{types}]  {endpoint['signing_secret_hint']}"


def cmd_webhooks(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except httpx.HTTPError as e:
        return fail(f"{args.server}: the server could not be reached ({type(e).__name__})", EXIT_ERROR)
    except RuntimeError as e:
        return fail(str(e), EXIT_ERROR)


def _run(args: argparse.Namespace) -> int:
    if args.action == "list":
        answer = _request(args, "GET", f"/webhook_endpoints?limit={max(0, min(args.limit, 100))}")
        lines = [_endpoint_line(e) for e in answer["data"]] or ["(no webhook endpoints)"]
    elif args.action == "create":
        body = {"name": args.name, "url": args.url, "event_types": args.event_types or list(WEBHOOK_EVENT_TYPES)}
        answer = _request(args, "POST", "/webhook_endpoints", body)
        lines = [_endpoint_line(answer), f"signing secret (shown once; verify deliveries with it): "
                 f"{answer['signing_secret']}"]
    elif args.action == "delete":
        answer = _request(args, "DELETE", f"/webhook_endpoints/{quote(args.endpoint_id, safe='')}")
        lines = [f"deleted {answer['id']}"]
    else:
        answer = _request(args, "POST", f"/webhook_endpoints/{quote(args.endpoint_id, safe='')}/test",
                          {"event_type": args.event_type})
        lines = [f"{answer['event_type']} sent to {answer['webhook_endpoint_id']}: the receiver answered HTTP "
                 f"{answer['status_code']}"]
    print(json.dumps(answer, indent=2) if args.json else "\n".join(lines), file=sys.stdout)
    return 0
