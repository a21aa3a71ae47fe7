"""A webhook delivery attempt (h3serve/engine/outbox/sender.py): the outbound URL guard (https; no loopback,
private, link-local or metadata address after DNS and on every redirect, unless the operator allows the host),
Standard Webhooks signatures the OpenAI SDK verifies, the answer read to a small bound, the short deadline."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from openai import InvalidWebhookSignatureError, OpenAI
from webhook_receiver import ENDLESS, HANG, receiver

from h3serve.engine.outbox.sender import AllowedHost, WebhookSender, WebhookURLGuard, WebhookURLRefused
from h3serve.engine.outbox.signing import signed_headers
from h3serve.jobstore.webhook_records import event_payload, new_secret

SDK = OpenAI(api_key="unused", base_url="http://127.0.0.1:9/v1")
PAYLOAD = event_payload("evt_1", "video.completed", "video_1", 1)


def resolver_to(address: str):
    """A resolver that answers every name with `address` (as a hostile or mistaken DNS record would)."""

    async def resolve(host: str, port: int) -> list[str]:
        return [host] if host[0].isdigit() or ":" in host else [address]

    return resolve


def send(guard: WebhookURLGuard, url: str, timeout_s: float = 5.0, secrets: tuple[str, ...] = ("whsec_a2V5",)):
    return asyncio.run(WebhookSender(guard, timeout_s=timeout_s).send(url, "wh_1", PAYLOAD, secrets))


@pytest.mark.parametrize("text, parsed", [
    ("127.0.0.1:8080", AllowedHost("127.0.0.1", 8080)), ("Hooks.Example.com", AllowedHost("hooks.example.com")),
    ("[::1]:9000", AllowedHost("::1", 9000)), ("::1", AllowedHost("::1")),
    ("localhost:80", AllowedHost("localhost", 80)),
])
def test_allowed_hosts_parse(text, parsed):
    assert AllowedHost.parse(text) == parsed and AllowedHost.parse(str(parsed)) == parsed


@pytest.mark.parametrize("text", ["", "host:port", "a/b", "user@host", "host:70000", "[::1]x"])
def test_bad_allowed_hosts_name_the_flag(text):
    with pytest.raises(ValueError, match="--webhook-allow-host"):
        AllowedHost.parse(text)


@pytest.mark.parametrize("url, why", [
    ("http://example.com/hook", "must use https"),  # http, not allowed
    ("https://127.0.0.1/hook", "loopback"),
    ("https://[::1]:8443/hook", "loopback"),
    ("https://10.1.2.3/hook", "private"),
    ("https://192.168.1.5/hook", "private"),
    ("https://169.254.169.254/latest/meta-data", "link-local"),  # the cloud metadata service
    ("https://hooks.example.com/x", "loopback"),  # a DNS name that resolves to 127.0.0.1
    ("https://user:pw@hooks.example.com/x", "credentials"),
    ("ftp://hooks.example.com/x", "https URL"),
    ("https://", "https URL"),
])
def test_the_guard_refuses_without_the_operators_allowance(url, why):
    guard = WebhookURLGuard(resolver=resolver_to("127.0.0.1"))
    with pytest.raises(WebhookURLRefused, match=why):
        asyncio.run(guard.check(url))
    result = send(guard, url)  # a delivery checks again, and is refused before connecting
    assert (result.outcome, result.status_code) == ("refused", None) and why in result.error


def test_an_allowed_host_takes_http_to_loopback_on_its_port_only():
    with receiver() as rx:
        guard = WebhookURLGuard([AllowedHost.parse(rx.host)])
        assert asyncio.run(guard.check(rx.url)) is not None
        result = send(guard, rx.url)
        assert (result.outcome, result.status_code, result.error) == ("delivered", 200, None)
        other_port = f"http://127.0.0.1:{rx.port + 1 if rx.port < 65535 else rx.port - 1}/hook"
        with pytest.raises(WebhookURLRefused, match="must use https"):
            asyncio.run(guard.check(other_port))
        [got] = rx.received
        assert got.path == "/hook" and json.loads(got.body) == json.loads(PAYLOAD)
        assert got.headers["content-type"] == "application/json" and got.headers["webhook-id"] == "wh_1"


@pytest.mark.parametrize("target, why", [
    ("http://127.0.0.1:{other}/steal", "must use https"),  # another loopback port: not the allowed host
    ("https://127.0.0.1:{other}/steal", "loopback"),
    ("https://metadata.internal/steal", "link-local"),  # a DNS name resolving to 169.254.169.254
    ("https://10.0.0.8/steal", "private"),
])
def test_every_redirect_hop_passes_the_guard(target, why):
    with receiver() as rx:
        rx.redirect_to = target.format(other=rx.port + 1)
        rx.answer(307)
        guard = WebhookURLGuard([AllowedHost.parse(rx.host)], resolver=resolver_to("169.254.169.254"))
        result = send(guard, rx.url)
        assert (result.outcome, result.status_code) == ("refused", None) and why in result.error
        assert len(rx.received) == 1  # nothing was sent past the redirect


def test_307_is_followed_with_the_body_and_302_is_not():
    with receiver() as rx:
        guard = WebhookURLGuard([AllowedHost.parse(rx.host)])
        rx.redirect_to = rx.url + "/moved"
        rx.answer(307)
        assert send(guard, rx.url).delivered
        assert [r.path for r in rx.received] == ["/hook", "/hook/moved"] and rx.received[1].body == PAYLOAD.encode()
        rx.answer(302)
        result = send(guard, rx.url)
        assert (result.outcome, result.status_code) == ("http_error", 302) and "307 and 308" in result.error


def test_answers_are_read_to_a_bound_and_attempts_end_at_their_deadline():
    with receiver() as rx:
        guard = WebhookURLGuard([AllowedHost.parse(rx.host)])
        rx.answer(ENDLESS)
        assert send(guard, rx.url, timeout_s=20).delivered  # a body that never ends: read 4 KiB, then hung up on
        rx.answer(HANG)  # held for 30 s: only the attempt's own deadline ends it sooner
        result = send(guard, rx.url, timeout_s=0.5)
        rx.release()
        assert (result.outcome, result.status_code, result.error) == ("timeout", None, "no answer within 0.5 s")
        rx.answer(503)
        result = send(guard, rx.url)
        assert (result.outcome, result.status_code, result.error) == ("http_error", 503, "the receiver answered "
                                                                      "HTTP 503: ok")
    result = send(guard, rx.url)  # the receiver is gone
    assert (result.outcome, result.status_code) == ("connection_error", None) and "ConnectError" in result.error


def test_signatures_are_what_the_sdk_verifies():
    current, previous = new_secret(), new_secret()
    stamp = int(time.time())
    headers = signed_headers("wh_1", stamp, PAYLOAD, [current, previous])
    assert headers["webhook-signature"].count("v1,") == 2
    for secret in (current, previous):  # in a rotation's grace period either secret verifies
        event = SDK.webhooks.unwrap(PAYLOAD, headers, secret=secret)
        assert (event.type, event.data.id, event.id) == ("video.completed", "video_1", "evt_1")
    with pytest.raises(InvalidWebhookSignatureError):
        SDK.webhooks.verify_signature(PAYLOAD.replace("video_1", "video_2"), headers, secret=current)
    with pytest.raises(InvalidWebhookSignatureError):
        SDK.webhooks.verify_signature(PAYLOAD, headers, secret=new_secret())
    old = signed_headers("wh_1", stamp - 301, PAYLOAD, [current])  # the SDK's five-minute tolerance
    with pytest.raises(InvalidWebhookSignatureError, match="too old"):
        SDK.webhooks.verify_signature(PAYLOAD, old, secret=current)
