"""Fetch media from http(s) and data URLs into files, with byte caps, a deadline, and an SSRF guard.

The guard (h3serve/engine/url_guard.py, shared with the webhook deliveries) resolves the host once, refuses it if
any address is loopback, private, link-local, multicast, reserved or otherwise not public, and then connects to
exactly the address it checked (the Host header and TLS SNI keep the name), so a DNS answer that changes between
the check and the connection cannot slip through. Redirects are followed by hand, each hop checked the same way.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import os
from pathlib import Path

import httpx

from h3serve.api.percent import percent_decode
from h3serve.engine.url_guard import (
    AddressPolicy,
    AddressRefused,
    Resolver,
    pinned_address,
    public_address_only,
    system_resolver,
)
from h3serve.errors import ClientError
from h3serve.media.raw import atomic_output

__all__ = ["MediaFetchError", "MediaFetcher", "public_address_only"]
MAX_REDIRECTS = 5
CHUNK_BYTES = 1 << 16
WRITE_BYTES = 1 << 20  # a download is written in pieces this large, each in a worker thread


def _write(dest: Path, data: bytes) -> None:
    with atomic_output(dest) as tmp:
        tmp.write_bytes(data)


def _move_into_place(part: Path, dest: Path) -> None:
    """A finished download becomes `dest` atomically (fsynced, then renamed)."""
    with atomic_output(dest) as tmp:
        os.replace(part, tmp)


def _discard(path: Path) -> None:
    path.unlink(missing_ok=True)


class MediaFetchError(ClientError, ValueError):
    """The URL cannot be used: the message is client-safe. `too_large` maps to 413, the rest to 400."""

    code = "invalid_media"

    def __init__(self, message: str, too_large: bool = False):
        super().__init__(message)
        self.too_large = too_large


def _parse_url(text: str, base: httpx.URL | None = None) -> httpx.URL:
    """`text` as an http(s) URL with a host (resolved against `base`, for a redirect's Location).

    `MediaFetchError` if it is anything else or malformed: httpx raises `InvalidURL` (no `httpx.HTTPError`)
    while parsing, and `idna.IDNAError` (a ValueError) only when `.host` is first read."""
    try:
        url = base.join(text) if base is not None else httpx.URL(text)
        scheme, host = url.scheme, url.host
    except (httpx.InvalidURL, ValueError):
        raise MediaFetchError("not a valid URL") from None
    if scheme not in ("http", "https") or not host:
        raise MediaFetchError("must be an http(s) or data URL")
    return url


def _data_url_bytes(url: str, max_bytes: int) -> tuple[bytes, str]:
    """The payload and media type of `data:[<type>][;base64],<data>`."""
    header, comma, payload = url[len("data:"):].partition(",")
    if not comma:
        raise MediaFetchError("not a valid data URL (no comma)")
    media_type = header.split(";")[0].strip() or "text/plain"
    if header.endswith(";base64"):
        payload = "".join(payload.split())
        if len(payload) * 3 // 4 > max_bytes + 2:
            raise MediaFetchError(f"the data URL holds more than {max_bytes // 2**20} MiB", too_large=True)
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise MediaFetchError("the data URL is not valid base64") from None
    else:
        data = percent_decode(payload.encode())
    if len(data) > max_bytes:
        raise MediaFetchError(f"the data URL holds more than {max_bytes // 2**20} MiB", too_large=True)
    return data, media_type


class MediaFetcher:
    """Downloads one URL into one file; `fetch` returns the media type the server declared.

    `timeout_s` bounds every download of one request together: `deadline()` starts that clock, and each
    `fetch` of the request is given the same deadline."""

    def __init__(
        self,
        timeout_s: float,
        allow_private: bool = False,
        resolver: Resolver = system_resolver,
        policy: AddressPolicy = public_address_only,
        max_redirects: int = MAX_REDIRECTS,
    ):
        self.timeout_s = timeout_s
        self.allow_private = allow_private
        self.resolver = resolver
        self.policy = policy
        self.max_redirects = max_redirects

    def deadline(self) -> float:
        """The event-loop time by which a request's downloads starting now must all have finished."""
        return asyncio.get_running_loop().time() + self.timeout_s

    async def fetch(self, url: str, dest: Path, max_bytes: int, deadline: float | None = None) -> str | None:
        """Write the URL's content to `dest` (atomically) by `deadline` (default: `timeout_s` from now).

        Raises `MediaFetchError` with a client-safe message."""
        if url.startswith("data:"):  # decoding up to 50 MiB of base64 is CPU work: off the loop too
            data, media_type = await asyncio.to_thread(_data_url_bytes, url, max_bytes)
            await asyncio.to_thread(_write, dest, data)
            return media_type
        try:
            async with asyncio.timeout_at(self.deadline() if deadline is None else deadline):
                return await self._fetch_http(url, dest, max_bytes)
        except TimeoutError:
            raise MediaFetchError(
                f"the download did not finish within the {self.timeout_s:g} s allowed for the request's media"
            ) from None
        except httpx.HTTPError as e:
            raise MediaFetchError(f"the download failed ({type(e).__name__})") from None

    async def _pinned_address(self, url: httpx.URL) -> str:
        """The checked address to connect to for `url`'s host."""
        port = url.port or (443 if url.scheme == "https" else 80)
        try:
            return await pinned_address(url.host, port, self.resolver, None if self.allow_private else self.policy)
        except AddressRefused as e:
            suffix = "" if e.reason is None else ", which media URLs may not reach"
            raise MediaFetchError(f"{e}{suffix}") from None

    async def _fetch_http(self, url: str, dest: Path, max_bytes: int) -> str | None:
        timeout = httpx.Timeout(self.timeout_s)
        async with httpx.AsyncClient(timeout=timeout, follow_redirects=False, trust_env=False) as client:
            target = _parse_url(url)
            for _ in range(self.max_redirects + 1):
                address = await self._pinned_address(target)
                request = client.build_request(
                    "GET",
                    target.copy_with(host=address),
                    headers={"Host": target.netloc.decode("ascii"), "Accept": "*/*"},
                    extensions={"sni_hostname": target.host} if target.scheme == "https" else {},
                )
                response = await client.send(request, stream=True)
                try:
                    if response.is_redirect:
                        target = _parse_url(response.headers.get("location", ""), base=target)
                        continue
                    if response.status_code != 200:
                        raise MediaFetchError(f"the URL answered HTTP {response.status_code}")
                    await self._save(response, dest, max_bytes)
                    content_type: str | None = response.headers.get("content-type")
                    return content_type
                finally:
                    await response.aclose()
        raise MediaFetchError(f"more than {self.max_redirects} redirects")

    @staticmethod
    async def _save(response: httpx.Response, dest: Path, max_bytes: int) -> None:
        too_large = MediaFetchError(f"the download is larger than {max_bytes // 2**20} MiB", too_large=True)
        declared = response.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > max_bytes:
            raise too_large
        part = dest.with_name(f".{dest.name}.part")
        try:
            f = await asyncio.to_thread(open, part, "wb")  # file I/O in worker threads: the loop serves others
            try:
                received, pending = 0, bytearray()
                async for chunk in response.aiter_bytes(CHUNK_BYTES):
                    received += len(chunk)
                    if received > max_bytes:
                        raise too_large
                    pending += chunk
                    if len(pending) >= WRITE_BYTES:
                        await asyncio.to_thread(f.write, pending)
                        pending.clear()
                await asyncio.to_thread(f.write, pending)
            finally:
                await asyncio.to_thread(f.close)
            await asyncio.to_thread(_move_into_place, part, dest)
        finally:
            await asyncio.to_thread(_discard, part)
