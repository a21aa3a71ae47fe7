"""The outbound URL guard, one home for every request the server makes on a client's behalf: media URLs
(h3serve/api/url_fetch.py) and webhook deliveries (h3serve/engine/outbox/sender.py).

A host is resolved once; if any address it resolves to is loopback, private, link-local (cloud metadata lives
there), multicast, reserved or otherwise not public, it is refused. Otherwise the caller connects to exactly the
address that was checked (the Host header and TLS SNI keep the name), so a DNS answer that changes between the check
and the connection cannot slip through. Callers check every redirect hop the same way.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Awaitable, Callable

from h3serve.errors import ClientError
from h3serve.rules.shown import shown

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
Resolver = Callable[[str, int], Awaitable[list[str]]]
AddressPolicy = Callable[[IPAddress], str | None]


class AddressRefused(ClientError, ValueError):
    """`host` cannot be reached: it did not resolve (`reason` None) or resolves to an address the policy refuses
    (`reason` says what kind). The message is client-safe."""

    code = "invalid_url"

    def __init__(self, host: str, reason: str | None):
        self.host = host
        self.reason = reason
        super().__init__(f"the host {shown(host)} could not be resolved" if reason is None
                         else f"the host {shown(host)} resolves to {reason}")


def public_address_only(ip: IPAddress) -> str | None:
    """Why `ip` may not be reached (None: it is a public unicast address)."""
    if isinstance(ip, ipaddress.IPv6Address):
        # IPv4 inside IPv6 (mapped ::ffff:a.b.c.d, 6to4 2002:ab:cd::, Teredo's client): judged as that IPv4.
        embedded = ip.ipv4_mapped or ip.sixtofour or (ip.teredo[1] if ip.teredo else None)
        if embedded is not None:
            inner = public_address_only(embedded)
            if inner is not None:
                return f"{inner} inside {ip}"
    for reason, hit in (
        ("an unspecified address", ip.is_unspecified),
        ("a loopback address", ip.is_loopback),
        ("a link-local address", ip.is_link_local),
        ("a private address", ip.is_private),
        ("a multicast address", ip.is_multicast),
        ("a reserved address", ip.is_reserved),
        ("not a public address", not ip.is_global),
    ):
        if hit:
            return reason
    return None


async def system_resolver(host: str, port: int) -> list[str]:
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return [str(info[4][0]) for info in infos]


async def pinned_address(host: str, port: int, resolver: Resolver, policy: AddressPolicy | None) -> str:
    """The one address to connect to for `host`: every address it resolves to must pass `policy` (None: any
    address may be reached, the operator allowed it). Raises `AddressRefused`."""
    try:
        addresses = await resolver(host, port)
    except (OSError, ValueError):  # no such name, or one getaddrinfo cannot take (a NUL, a label too long)
        raise AddressRefused(host, None) from None
    if not addresses:
        raise AddressRefused(host, None)
    for address in addresses:
        ip = ipaddress.ip_address(address.split("%")[0])
        reason = None if policy is None else policy(ip)
        if reason:
            raise AddressRefused(host, reason)
    return addresses[0].split("%")[0]
