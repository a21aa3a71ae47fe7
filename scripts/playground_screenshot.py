"""The docs' picture of the web playground after a T2VA job on the shipped demo checkpoint (or one of its ready
examples, by its button's title).

    python scripts/playground_screenshot.py docs/playground.png [--prompt PROMPT]
    python scripts/playground_screenshot.py docs/playground_examples.png --example "Last frame: a blue ball moving up"

Starts `h3serve serve` without `--model` (the demo checkpoint) on a free port with a throwaway data dir, opens the
page in headless Debian Chromium (Playwright; `make test` installs it, or set H3SERVE_CHROMIUM), runs the demo
prompt at the demo's length, steps and seed 0, waits for the player, scrubs the frame strip to the middle and
writes a full-page PNG.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

from playwright.sync_api import expect, sync_playwright

from h3serve.demo.shipped import DEMO_DURATION_S, DEMO_PROMPT, DEMO_STEPS
from h3serve.tools.live_server import wait_healthy

CHROMIUM_NAMES = ("chromium", "chromium-browser")
JOB_TIMEOUT_MS = 300_000


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--prompt", default=DEMO_PROMPT)
    parser.add_argument("--example", help="click this ready example (its button's title) instead of typing a prompt")
    args = parser.parse_args()
    chromium = os.environ.get("H3SERVE_CHROMIUM") or next(filter(None, map(shutil.which, CHROMIUM_NAMES)), None)
    if chromium is None:
        sys.exit("error: Chromium not found (apt-get install chromium, or set H3SERVE_CHROMIUM)")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory(prefix="h3serve-shot-") as data:
        command = [sys.executable, "-m", "h3serve", "serve", "--port", str(port), "--data-dir", data,
                   "--log-level", "warning"]
        proc = subprocess.Popen(command, start_new_session=True)
        try:
            wait_healthy(url, 120, proc)
            with sync_playwright() as playwright:
                browser = playwright.chromium.launch(executable_path=chromium, headless=True)
                page = browser.new_page(viewport={"width": 1280, "height": 900})
                page.goto(url)
                expect(page.locator("body")).to_have_attribute("data-ready", "true")
                if args.example:  # its task, prompt, duration, steps, seed and files
                    page.get_by_role("button", name=args.example).click()
                    expect(page.get_by_label("Prompt")).not_to_have_value("")
                else:
                    page.get_by_label("Prompt").fill(args.prompt)
                    for selector, value in {"#seconds": f"{DEMO_DURATION_S:g}", "#steps": str(DEMO_STEPS),
                                            "#seed": "0"}.items():
                        page.fill(selector, value)
                page.get_by_role("button", name="Generate").click()
                expect(page.locator("#job-stage")).to_have_text("Done", timeout=JOB_TIMEOUT_MS)
                page.wait_for_function("document.getElementById('player').readyState >= 2")
                page.evaluate("() => { const p = document.getElementById('player'); p.currentTime = p.duration / 2; }")
                scrub = page.locator("#scrub-view")
                scrub.scroll_into_view_if_needed()
                box = scrub.bounding_box()
                scrub.hover(position={"x": box["width"] * 0.5, "y": box["height"] / 2})
                # the seek done and the frame there decoded, so the player shows no loading spinner
                page.wait_for_function("(() => { const p = document.getElementById('player');"
                                       " return !p.seeking && p.readyState >= 3; })()")
                page.wait_for_timeout(1500)
                args.out.parent.mkdir(parents=True, exist_ok=True)
                page.screenshot(path=str(args.out), full_page=True)
                browser.close()
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
