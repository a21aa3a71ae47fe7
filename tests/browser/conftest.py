"""One `h3serve serve` on the tiny checkpoint and one headless Debian Chromium per module, driven by Playwright.

Chromium comes from the system (`make test` installs Debian's `chromium` package when it is missing): nothing
is downloaded at test time. Screenshots go to tests/browser/screenshots/ (gitignored; $H3SERVE_SCREENSHOTS overrides).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from browser_pages import API_KEY, chromium_path, close_page, open_page
from playwright.sync_api import Browser, expect, sync_playwright

sys.path.insert(0, str(Path(__file__).parent.parent / "api"))  # api_servers: the live-server helpers
from api_servers import start_live_server  # noqa: E402

expect.set_options(timeout=20_000)  # two shared cores: the page's own work may take a few seconds


@pytest.fixture(scope="module")
def live(tiny_checkpoint, tmp_path_factory):
    # The cancel test's 15 s, 200-step job is past the default --max-request-cost on purpose. Webhooks may reach a
    # receiver on loopback (the gallery test's).
    server = start_live_server(tiny_checkpoint, tmp_path_factory.mktemp("browser-data"), "--api-key", API_KEY,
                               "--poll-after-ms", "100", "--max-request-cost", "1e6", "--webhook-allow-host",
                               "127.0.0.1")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def browser() -> Browser:
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium_path(), headless=True)
        yield browser
        browser.close()


@pytest.fixture(scope="session")
def screenshots() -> Path:
    path = Path(os.environ.get("H3SERVE_SCREENSHOTS") or Path(__file__).parent / "screenshots")
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture
def page(browser, live):
    page = open_page(browser, live.url)
    yield page
    close_page(page)
