"""Opening the playground in a browser tab, as a person would: the page loads, the API key is typed once."""

from __future__ import annotations

import os
import shutil

import pytest
from playwright.sync_api import Browser, Page, expect

API_KEY = "browser-key"
CHROMIUM_NAMES = ("chromium", "chromium-browser")


def chromium_path() -> str:
    path = os.environ.get("H3SERVE_CHROMIUM") or next(filter(None, map(shutil.which, CHROMIUM_NAMES)), None)
    if path is None:
        pytest.fail("Chromium not found: `make test` installs it (apt-get install chromium), or set H3SERVE_CHROMIUM")
    return path


def open_page(browser: Browser, url: str, width: int = 1280, height: int = 900) -> Page:
    """A new tab on the playground, its API key typed into the key field (kept in sessionStorage).

    JavaScript errors on the page are collected in `page.js_errors` (checked by `close_page`)."""
    context = browser.new_context(viewport={"width": width, "height": height},
                                  permissions=["clipboard-read", "clipboard-write"])
    page = context.new_page()
    page.js_errors = []
    page.on("pageerror", lambda error: page.js_errors.append(error))
    page.goto(url)
    expect(page.locator("body")).to_have_attribute("data-ready", "true")
    key = page.get_by_label("API key (kept in this tab only")
    expect(key).to_be_visible()  # the server requires a key, so the page opens its box
    key.fill(API_KEY)
    key.press("Enter")
    expect(page.locator("#history-error")).to_be_empty()
    assert API_KEY not in page.url
    assert page.evaluate("sessionStorage.getItem('h3serve-api-key')") == API_KEY
    return page


def close_page(page: Page) -> None:
    errors = list(page.js_errors)
    page.context.close()
    assert not errors, f"JavaScript errors on the page: {errors}"
