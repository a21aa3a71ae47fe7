"""Media URL fetching: the SSRF guard (redirects included), byte caps, the deadline, data URLs."""

from __future__ import annotations

import asyncio
import base64
import ipaddress
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from h3serve.api.error_envelope import APIError
from h3serve.api.intake.generation_request import store_media
from h3serve.api.intake.read import MediaSource
from h3serve.api.url_fetch import MediaFetcher, MediaFetchError, public_address_only

PAYLOAD = bytes(range(256)) * 64  # 16 KiB


class _Handler(BaseHTTPRequestHandler):
    hosts: list[str] = []

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        _Handler.hosts.append(self.headers["Host"])
        if self.path == "/file":
            self._send(PAYLOAD, length=True)
        elif self.path == "/chunked":
            self._send(PAYLOAD, length=False)
        elif self.path.startswith("/redirect"):
            self.send_response(302)
            self.send_header("Location", self.path.split("?to=", 1)[1])
            self.send_header("Content-Length", "0")
            self.end_headers()
        elif self.path == "/slow":
            time.sleep(2)
            self._send(PAYLOAD, length=True)
        elif self.path == "/a-while":
            time.sleep(0.6)
            self._send(PAYLOAD, length=True)
        else:
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()

    def _send(self, data: bytes, length: bool) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "application/octet-stream")
        if length:
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        else:  # HTTP/1.0 style: the body ends when the connection closes
            self.end_headers()
            self.wfile.write(data)
            self.close_connection = True


@pytest.fixture(scope="module")
def server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


def fetch(fetcher: MediaFetcher, url: str, dest, max_bytes: int = 1 << 20) -> str | None:
    return asyncio.run(fetcher.fetch(url, dest, max_bytes))


def refused(fetcher: MediaFetcher, url: str, dest, max_bytes: int = 1 << 20) -> MediaFetchError:
    with pytest.raises(MediaFetchError) as e:
        fetch(fetcher, url, dest, max_bytes)
    assert not dest.exists() and not [p for p in dest.parent.iterdir() if p.name.startswith(".")]  # no leftovers
    return e.value


@pytest.mark.parametrize(
    "address, reason",
    [
        ("127.0.0.1", "loopback"),
        ("::1", "loopback"),
        ("::ffff:127.0.0.1", "loopback"),
        ("10.1.2.3", "private"),
        ("192.168.0.10", "private"),
        ("169.254.169.254", "link-local"),
        ("fe80::1", "link-local"),
        ("0.0.0.0", "unspecified"),
        ("224.0.0.1", "multicast"),
        ("100.64.0.1", "not a public"),
        ("8.8.8.8", None),
        ("2002:a9fe:a9fe::", "link-local"),  # 6to4 around 169.254.169.254
        ("2002:c0a8:1::", "private"),  # 6to4 around 192.168.0.1
        ("::ffff:127.0.0.1", "loopback"),
        ("2002:808:808::", None),  # 6to4 around 8.8.8.8
        ("2606:4700:4700::1111", None),
    ],
)
def test_address_policy(address, reason):
    result = public_address_only(ipaddress.ip_address(address))
    assert (result is None) if reason is None else (reason in result)


@pytest.mark.parametrize("url", ["http://127.0.0.1:9/x.png", "http://localhost:9/x.png", "http://[::1]:9/x.png"])
def test_loopback_urls_are_refused_before_connecting(tmp_path, url):
    err = refused(MediaFetcher(timeout_s=5), url, tmp_path / "out")
    assert "loopback" in str(err)


def test_only_http_and_data_urls(tmp_path):
    assert "http(s)" in str(refused(MediaFetcher(timeout_s=5), "file:///etc/passwd", tmp_path / "out"))


@pytest.mark.parametrize("url", ["http://[::1", "http://host:port/x.png", "http://a\x00b/", "https://xn--/x.png"])
def test_malformed_urls_are_a_fetch_error(tmp_path, url):
    assert "not a valid URL" in str(refused(MediaFetcher(timeout_s=5), url, tmp_path / "out"))


def test_a_malformed_redirect_is_a_fetch_error(server, tmp_path):
    fetcher = MediaFetcher(timeout_s=5, allow_private=True)
    refused(fetcher, f"http://{server}/redirect?to=http://host:port/x", tmp_path / "out")


def test_allowed_private_fetch_writes_the_file(server, tmp_path):
    dest = tmp_path / "out"
    assert fetch(MediaFetcher(timeout_s=5, allow_private=True), f"http://{server}/file", dest) == (
        "application/octet-stream"
    )
    assert dest.read_bytes() == PAYLOAD
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


@pytest.mark.parametrize("path", ["/file", "/chunked"])
def test_byte_cap_with_and_without_content_length(server, tmp_path, path):
    err = refused(MediaFetcher(timeout_s=5, allow_private=True), f"http://{server}{path}", tmp_path / "out",
                  max_bytes=len(PAYLOAD) - 1)
    assert err.too_large


def test_redirect_to_a_forbidden_host_is_refused(server, tmp_path):
    port = server.split(":")[1]
    names = {"public.test": ["127.0.0.1"], "internal.test": ["10.1.2.3"]}

    async def resolver(host: str, _port: int) -> list[str]:
        return names[host]

    def only_10_is_private(ip):  # lets the test server stand in for a public host
        return "a private address" if ip in ipaddress.ip_network("10.0.0.0/8") else None

    fetcher = MediaFetcher(timeout_s=5, resolver=resolver, policy=only_10_is_private)
    _Handler.hosts.clear()
    dest = tmp_path / "out"
    fetch(fetcher, f"http://public.test:{port}/redirect?to=/file", dest)  # a same-host redirect is followed
    assert dest.read_bytes() == PAYLOAD
    assert _Handler.hosts == [f"public.test:{port}"] * 2  # connected to the checked address, with the Host name
    err = refused(fetcher, f"http://public.test:{port}/redirect?to=http://internal.test/secret", tmp_path / "o2")
    assert "internal.test" in str(err) and "private" in str(err)


def test_deadline(server, tmp_path):
    err = refused(MediaFetcher(timeout_s=0.5, allow_private=True), f"http://{server}/slow", tmp_path / "out")
    assert "0.5 s" in str(err)


def test_the_deadline_covers_every_url_of_a_request_together(server, tmp_path):
    fetcher = MediaFetcher(timeout_s=1.0, allow_private=True)
    sources = tuple(MediaSource(f"image_reference[{i}]", "image", url=f"http://{server}/a-while") for i in range(2))
    with pytest.raises(APIError) as e:  # 0.6 s each: either alone fits in 1 s, both together do not
        asyncio.run(store_media(sources, tmp_path, fetcher))
    assert (e.value.status, e.value.param) == (400, "image_reference[1]") and "1 s" in e.value.message
    assert len(asyncio.run(store_media(sources[:1], tmp_path, fetcher))) == 1


def test_http_errors_are_reported(server, tmp_path):
    err = refused(MediaFetcher(timeout_s=5, allow_private=True), f"http://{server}/missing", tmp_path / "out")
    assert "HTTP 404" in str(err)


def test_data_urls(tmp_path):
    fetcher = MediaFetcher(timeout_s=5)
    url = "data:image/png;base64," + base64.b64encode(PAYLOAD).decode()
    assert fetch(fetcher, url, tmp_path / "a") == "image/png"
    assert (tmp_path / "a").read_bytes() == PAYLOAD
    assert refused(fetcher, url, tmp_path / "b", max_bytes=1000).too_large
    assert "base64" in str(refused(fetcher, "data:image/png;base64,@@@@", tmp_path / "c"))
