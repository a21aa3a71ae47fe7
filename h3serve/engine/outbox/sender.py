"""One webhook delivery attempt: a signed POST to the endpoint's URL, through the outbound URL guard.

A webhook URL is a request the server makes for a client, so the media-URL guard applies (h3serve/engine/
url_guard.py): no loopback, private, link-local or metadata address, checked after DNS and again on every redirect
hop, and the connection goes to the address that was checked. `https` is required. An operator may allow hosts
(`serve --webhook-allow-host HOST[:PORT]`): a URL on one of them may use http and reach any address, which is how
a private deployment (or a test) reaches a receiver on its own network. Only 307 and 308 redirects are followed (a
POST stays a POST with its body). The whole attempt has one short deadline, and the receiver's answer is read to a
small bound.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, get_args

import httpx

import h3serve
from h3serve.engine.outbox.signing import signed_headers
from h3serve.engine.url_guard import (
    AddressPolicy,
    AddressRefused,
    Resolver,
    pinned_address,
    public_address_only,
    system_resolver,
)
from h3serve.errors import ClientError
from h3serve.rules import limits

AttemptOutcome = Literal["delivered", "http_error", "connection_error", "timeout", "refused"]
ATTEMPT_OUTCOMES: tuple[AttemptOutcome, ...] = get_args(AttemptOutcome)
_FOLLOWED_REDIRECTS = (307, 308)
_SNIPPET_CHARS = 200  # of a receiver's answer, in a failed attempt's error
_DEFAULT_PORTS = {"http": 80, "https": 443}


class WebhookURLRefused(ClientError, ValueError):
    """A webhook URL the guard refuses; the message names why (client-safe: no secret, no server path)."""

    code = "invalid_url"


def _port(url: httpx.URL) -> int:
    return url.port or _DEFAULT_PORTS.get(url.scheme, 0)


@dataclass(frozen=True)
class AllowedHost:
    """A host an operator lets webhook URLs reach over http and at any address; `port` None: any port."""

    host: str
    port: int | None = None

    @classmethod
    def parse(cls, text: str) -> AllowedHost:
        """`HOST`, `HOST:PORT`, or an IPv6 address (`::1`, `[::1]:8080`). `ValueError` naming the value."""
        value = text.strip()
        host, port_text = value, ""
        if value.startswith("["):
            host, _, rest = value[1:].partition("]")
            if rest and not rest.startswith(":"):
                raise ValueError(f"--webhook-allow-host: expected HOST[:PORT], got {text!r}")
            port_text = rest[1:]
        elif value.count(":") == 1:
            host, _, port_text = value.partition(":")
        try:
            parsed = httpx.URL(f"http://[{host}]/" if ":" in host else f"http://{host}/")
            name = parsed.host
        except (httpx.InvalidURL, ValueError):
            name = ""
        if not name or parsed.path != "/" or parsed.userinfo or (port_text and not port_text.isdigit()):
            raise ValueError(f"--webhook-allow-host: expected HOST[:PORT], got {text!r}")
        port = int(port_text) if port_text else None
        if port is not None and not 1 <= port <= 65535:
            raise ValueError(f"--webhook-allow-host: the port must be in 1..65535, got {text!r}")
        return cls(name.lower(), port)

    def matches(self, url: httpx.URL) -> bool:
        return url.host.lower() == self.host and (self.port is None or self.port == _port(url))

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return host if self.port is None else f"{host}:{self.port}"


class WebhookURLGuard:
    """Which URLs deliveries may go to, and the checked address to connect to for each."""

    def __init__(self, allowed: Sequence[AllowedHost] = (), resolver: Resolver = system_resolver,
                 policy: AddressPolicy = public_address_only):
        self.allowed = tuple(allowed)
        self.resolver = resolver
        self.policy = policy

    def allows(self, url: httpx.URL) -> bool:
        """Whether the operator allowed this URL's host (and port)."""
        return any(host.matches(url) for host in self.allowed)

    def parse(self, text: str, base: httpx.URL | None = None) -> httpx.URL:
        """`text` (a redirect's Location against `base`) as a webhook URL: https with a host and no credentials,
        or http to an allowed host. `WebhookURLRefused` otherwise."""
        try:
            url = base.join(text) if base is not None else httpx.URL(text)
            scheme, host = url.scheme, url.host
        except (httpx.InvalidURL, ValueError):
            raise WebhookURLRefused("not a valid URL") from None
        if scheme not in _DEFAULT_PORTS or not host:
            raise WebhookURLRefused("must be an https URL with a host")
        if url.userinfo:
            raise WebhookURLRefused("must not carry credentials (user:password@); sign-in is the signature's job")
        if scheme != "https" and not self.allows(url):
            raise WebhookURLRefused(f"must use https (http only to a host the operator allows with `serve "
                                    f"--webhook-allow-host`), got {scheme}://{host}")
        return url

    async def address(self, url: httpx.URL) -> str:
        """The address to connect to for `url`: any for an allowed host, else only a public one."""
        try:
            return await pinned_address(url.host, _port(url), self.resolver,
                                        None if self.allows(url) else self.policy)
        except AddressRefused as e:
            if e.reason is None:
                raise WebhookURLRefused(str(e)) from None
            raise WebhookURLRefused(
                f"{e}, which webhook URLs may not reach unless the operator allows the host "
                f"(serve --webhook-allow-host {url.host}:{_port(url)})"
            ) from None

    async def check(self, text: str) -> httpx.URL:
        """A URL a client gives for an endpoint, checked now as every delivery will check it again."""
        url = self.parse(text)
        await self.address(url)
        return url


@dataclass(frozen=True)
class AttemptResult:
    """How one attempt went. `status_code`: the receiver's answer, if it answered."""

    outcome: AttemptOutcome
    status_code: int | None = None
    error: str | None = None  # client-safe; None when delivered

    @property
    def delivered(self) -> bool:
        return self.outcome == "delivered"


async def _answer_snippet(response: httpx.Response, max_bytes: int) -> str:
    """The start of the receiver's answer (read to `max_bytes`, the rest left unread), as one short line."""
    received = bytearray()
    async for chunk in response.aiter_raw():
        received += chunk
        if len(received) >= max_bytes:
            break
    text = bytes(received[:max_bytes]).decode("utf-8", "replace")
    return " ".join("".join(c if c.isprintable() else " " for c in text).split())[:_SNIPPET_CHARS]


class WebhookSender:
    """Sends one signed delivery attempt at a time (`send`); safe to share between tasks of one event loop."""

    def __init__(self, guard: WebhookURLGuard, timeout_s: float = limits.WEBHOOK_TIMEOUT_S,
                 max_response_bytes: int = limits.WEBHOOK_RESPONSE_BYTES,
                 max_redirects: int = limits.WEBHOOK_MAX_REDIRECTS):
        self.guard = guard
        self.timeout_s = timeout_s
        self.max_response_bytes = max_response_bytes
        self.max_redirects = max_redirects

    async def send(self, url: str, webhook_id: str, payload: str, secrets: Sequence[str]) -> AttemptResult:
        """POST `payload` to `url`, signed with `secrets` at the current time. Never raises: every failure is an
        `AttemptResult` whose error says what happened."""
        headers = {
            **signed_headers(webhook_id, int(time.time()), payload, secrets),
            "content-type": "application/json",
            "user-agent": f"h3serve/{h3serve.__version__} (webhooks)",
        }
        try:
            async with asyncio.timeout(self.timeout_s):
                return await self._post(url, payload.encode(), headers)
        except TimeoutError:
            return AttemptResult("timeout", error=f"no answer within {self.timeout_s:g} s")
        except WebhookURLRefused as e:
            return AttemptResult("refused", error=str(e))
        except (httpx.HTTPError, OSError) as e:
            return AttemptResult("connection_error", error=f"the request failed ({type(e).__name__})")

    async def _post(self, url: str, body: bytes, headers: dict[str, str]) -> AttemptResult:
        timeout = httpx.Timeout(self.timeout_s)
        async with httpx.AsyncClient(timeout=timeout, follow_redirects=False, trust_env=False) as client:
            target = self.guard.parse(url)
            status = 0
            for _ in range(self.max_redirects + 1):
                address = await self.guard.address(target)
                request = client.build_request(
                    "POST", target.copy_with(host=address), content=body,
                    headers={**headers, "Host": target.netloc.decode("ascii")},
                    extensions={"sni_hostname": target.host} if target.scheme == "https" else {},
                )
                response = await client.send(request, stream=True)
                try:
                    status = response.status_code
                    location = response.headers.get("location")
                    if status in _FOLLOWED_REDIRECTS and location:
                        target = self.guard.parse(location, base=target)
                        continue
                    snippet = await _answer_snippet(response, self.max_response_bytes)
                finally:
                    await response.aclose()
                if 200 <= status < 300:
                    return AttemptResult("delivered", status)
                note = " (deliveries follow only 307 and 308 redirects)" if 300 <= status < 400 else ""
                return AttemptResult("http_error", status, f"the receiver answered HTTP {status}{note}"
                                     + (f": {snippet}" if snippet else ""))
        return AttemptResult("http_error", status, f"more than {self.max_redirects} redirects")
