"""One `h3serve serve` on the tiny checkpoint and one headless Debian Chromium per module, driven by Playwright.

Chromium comes from the system (`make test` installs Debian's `chromium` package when it is missing): nothing
is downloaded at test time. Screenshots go to `<pytest basetemp>/screenshots/`.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest
from playwright.sync_api import Browser, Page, expect, sync_playwright

sys.path.insert(0, str(Path(__file__).parent.parent / "api"))  # api_servers: the live-server helpers
from api_servers import start_live_server  # noqa: E402

API_KEY = "browser-key"
CHROMIUM_NAMES = ("chromium", "chromium-browser")


def chromium_path() -> str:
    path = os.environ.get("H3SERVE_CHROMIUM") or next(filter(None, map(shutil.which, CHROMIUM_NAMES)), None)
    if path is None:
        pytest.fail("Chromium not found: `make test` installs it (apt-get install chromium), or set H3SERVE_CHROMIUM")
    return path


@pytest.fixture(scope="module")
def live(tiny_checkpoint, tmp_path_factory):
    server = start_live_server(tiny_checkpoint, tmp_path_factory.mktemp("browser-data"), "--api-key", API_KEY,
                               "--poll-after-ms", "100")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def browser() -> Browser:
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium_path(), headless=True)
        yield browser
        browser.close()


@pytest.fixture(scope="session")
def screenshots(tmp_path_factory) -> Path:
    path = tmp_path_factory.getbasetemp() / "screenshots"
    path.mkdir(exist_ok=True)
    return path


def open_page(browser: Browser, url: str, width: int = 1280, height: int = 900) -> Page:
    """The playground with the API key typed once into its field, as a person would."""
    context = browser.new_context(viewport={"width": width, "height": height},
                                  permissions=["clipboard-read", "clipboard-write"])
    page = context.new_page()
    page.on("pageerror", lambda error: pytest.fail(f"JavaScript error on the page: {error}"))
    page.goto(url)
    expect(page.locator("body")).to_have_attribute("data-ready", "true")
    key = page.get_by_label("API key (kept in this tab only")
    expect(key).to_be_visible()  # the server requires a key, so the page opens its box
    key.fill(API_KEY)
    key.press("Enter")
    key.dispatch_event("change")
    assert API_KEY not in page.url
    return page


@pytest.fixture
def page(browser, live):
    page = open_page(browser, live.url)
    yield page
    page.context.close()
