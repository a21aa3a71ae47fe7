"""`h3serve webhooks list|create|delete|test` against a live server: what an operator types, what the server keeps."""

from __future__ import annotations

import json

from api_servers import API_KEY
from openai import OpenAI
from webhook_receiver import receiver
from webhook_servers import serve_webhooks

from h3serve.entrypoints.cli import main

SDK = OpenAI(api_key="unused", base_url="http://127.0.0.1:9/v1")


def run(capsys, server_url: str, *argv: str, key: str | None = API_KEY) -> tuple[int, str, str]:
    code = main(["webhooks", "--server", server_url, *(["--api-key", key] if key else []), *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_an_operator_creates_lists_tests_and_deletes_endpoints(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("H3SERVE_API_KEY", raising=False)
    with receiver() as rx, serve_webhooks(tmp_path / "data", webhook_allow_hosts=(rx.host,)) as server:
        code, out, _ = run(capsys, server.url, "--json", "create", "--name", "ops", "--url", rx.url,
                           "--event-type", "video.failed")
        made = json.loads(out)
        assert code == 0 and made["event_types"] == ["video.failed"] and made["signing_secret"].startswith("whsec_")
        code, out, _ = run(capsys, server.url, "create", "--name", "all", "--url", rx.url)
        assert code == 0 and "[video.completed,video.failed]" in out and "signing secret (shown once" in out

        code, out, _ = run(capsys, server.url, "list")
        lines = out.strip().splitlines()
        assert code == 0 and len(lines) == 2 and lines[1].startswith(made["id"]) and made["signing_secret"] not in out

        code, out, _ = run(capsys, server.url, "test", made["id"], "--event-type", "video.failed")
        assert code == 0 and out.strip().endswith("the receiver answered HTTP 200")
        [got] = rx.received
        assert SDK.webhooks.unwrap(got.body, got.headers, secret=made["signing_secret"]).type == "video.failed"

        code, out, _ = run(capsys, server.url, "delete", made["id"])
        assert code == 0 and out.strip() == f"deleted {made['id']}"
        code, _, err = run(capsys, server.url, "delete", made["id"])
        assert code == 1 and "HTTP 404: Webhook endpoint with id" in err
        code, _, err = run(capsys, server.url, "create", "--name", "x", "--url", "https://127.0.0.1/x")
        assert code == 1 and "loopback" in err
        code, _, err = run(capsys, server.url, "list", key=None)
        assert code == 1 and "HTTP 401" in err
