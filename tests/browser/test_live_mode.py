"""The playground's Live mode in headless Chromium: a real-time session played through Media Source Extensions as
it arrives, each chunk's latency listed, and a prompt typed mid-session taking effect at a chunk boundary, on the
server's fake real-time engine (its frames are painted in the colour of their prompt, tests/fake_realtime.py)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from axe_playwright_python.sync_playwright import Axe
from browser_pages import API_KEY, close_page, open_page
from fake_realtime import FakeRealtimeExecutor, prompt_colour
from playwright.sync_api import Page, expect

from h3serve.rules.realtime_geometry import published_frames

sys.path.insert(0, str(Path(__file__).parent.parent / "api" / "realtime"))  # the real-time test server
from realtime_servers import serve_realtime  # noqa: E402

pytestmark = pytest.mark.slow  # Chromium, and a session that plays in real time
FIRST, SECOND = "a lighthouse at dusk", "a red fox in snow"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with serve_realtime(tmp_path_factory.mktemp("live-page"), FakeRealtimeExecutor(chunk_s=0.6),
                        api_key=API_KEY) as server:
        yield server


@pytest.fixture
def page(browser, server):
    page = open_page(browser, server.url)
    yield page
    close_page(page)


def colour_at(page: Page, seconds: float) -> list[float]:
    """The live player's picture at `seconds` (seeked), as the mean RGB of its right-hand quarter."""
    return page.evaluate(
        """async t => {
            const video = document.getElementById("live-player");
            video.pause();
            const seeked = new Promise(done => video.addEventListener("seeked", done, { once: true }));
            video.currentTime = t;
            await seeked;
            const canvas = document.createElement("canvas");
            canvas.width = video.videoWidth;
            canvas.height = video.videoHeight;
            const context = canvas.getContext("2d");
            context.drawImage(video, 0, 0);
            const x = Math.floor(canvas.width * 3 / 4);
            const pixels = context.getImageData(x, 0, canvas.width - x, canvas.height).data;
            const sum = [0, 0, 0];
            for (let i = 0; i < pixels.length; i += 4) for (let c = 0; c < 3; c++) sum[c] += pixels[i + c];
            return sum.map(v => v / (pixels.length / 4));
        }""",
        seconds,
    )


def test_live_plays_chunks_as_they_come_and_switches_prompt(page, server, screenshots):
    expect(page.locator("#live")).to_be_visible()
    page.get_by_label("Describe the live video").fill(FIRST)
    page.get_by_label("Live width").fill("64")
    page.get_by_label("Live height").fill("64")
    page.get_by_label("Live duration (s)").fill("15")  # 12 chunks, one every 0.6 s
    page.get_by_role("button", name="Start live").click()
    rows = page.locator("#live-chunks li")
    expect(rows.first).to_contain_text("chunk 0")
    page.get_by_label("Change the description (from the next chunk on)").fill(SECOND)
    page.get_by_role("button", name="Send").click()
    expect(page.locator("#live-status")).to_contain_text("Prompt queued")
    # it plays while it arrives: past the third chunk's first frame before the session ends
    third = sum(published_frames(i, 12)[1] for i in range(2)) / 24
    page.wait_for_function(f"document.getElementById('live-player').currentTime > {third + 0.2}", timeout=30_000)
    assert page.locator("#live-chunks li").count() < 13, "the whole session had arrived before it played"
    expect(page.locator("#live-status")).to_contain_text("Done: 13 segments", timeout=30_000)
    page.screenshot(path=str(screenshots / "live-mode.png"), full_page=True)

    texts = rows.all_text_contents()
    media = [t for t in texts if t.startswith("chunk ")]
    assert len(media) == 12 and texts[-1].startswith("trailer")
    assert all(re.search(r"after \d+\.\d\d s", t) for t in media)
    switched = [i for i, t in enumerate(media) if SECOND in t]
    assert len(switched) == 1 and switched[0] >= 1
    expect(page.locator("#live-stats")).to_contain_text("time to first chunk")
    expect(page.locator("#live-stats")).to_contain_text("real-time factor")
    # the pictures change at that chunk: the one before shows the first prompt's colour, the one after the second's
    switch = switched[0]
    assert server.executor.streams[-1].prompts == [FIRST] * switch + [SECOND] * (12 - switch)
    start = sum(published_frames(i, 12)[1] for i in range(switch)) / 24
    for seconds, prompt in ((start - 0.3, FIRST), (start + 0.3, SECOND)):
        colour, expected = colour_at(page, seconds), prompt_colour(prompt).tolist()
        assert max(abs(a - b) for a, b in zip(colour, expected, strict=True)) < 12, (prompt, colour, expected)
    assert page.evaluate("document.getElementById('live-player').error") is None

    results = Axe().run(page, context="#live")
    bad = [v for v in results.response["violations"] if v["impact"] in ("critical", "serious")]
    assert not bad, results.generate_report()


def test_stop_ends_the_session_after_the_chunk_in_flight(page, server):
    page.get_by_label("Describe the live video").fill(FIRST)
    page.get_by_label("Live width").fill("64")
    page.get_by_label("Live height").fill("64")
    page.get_by_role("button", name="Start live").click()
    expect(page.locator("#live-chunks li").first).to_contain_text("chunk 0")
    page.get_by_role("button", name="Stop").click()
    expect(page.locator("#live-status")).to_contain_text("Stopped after")
    expect(page.get_by_role("button", name="Start live")).to_be_enabled()
    expect(page.locator("#live-error")).to_be_empty()
