"""The web playground in a real browser (headless Debian Chromium) against `h3serve serve` on the tiny checkpoint.

Every job is short (4 s, 1 step, 128x64): the point is the page, not the model.
"""

from __future__ import annotations

import base64
import json
import os
import re
import subprocess
import sys

import httpx
import pytest
from axe_playwright_python.sync_playwright import Axe
from browser_pages import API_KEY, close_page, open_page
from media_files import mp4, png, wav
from playwright.sync_api import Page, expect
from waiting import wait_until
from webhook_receiver import receiver

pytestmark = pytest.mark.slow

JOB_TIMEOUT_MS = 180_000
FAST = {"#seconds": "4", "#steps": "1", "#seed": "7"}
HEADERS = {"Authorization": f"Bearer {API_KEY}"}
FRAMES_4S = 107  # 4 s at 24 fps snapped up to 17n + 5


def fill(page: Page, prompt: str, values: dict[str, str] = FAST) -> None:
    page.get_by_label("Prompt").fill(prompt)
    for selector, value in values.items():
        page.fill(selector, value)


def generate_and_wait(page: Page) -> None:
    page.get_by_role("button", name="Generate").click()
    expect(page.locator("#job-stage")).to_have_text("Done", timeout=JOB_TIMEOUT_MS)
    expect(page.locator("#job-progress")).to_have_js_property("value", 100)
    expect(page.locator("#result")).to_be_visible()
    page.wait_for_function("document.getElementById('player').readyState >= 1")


def job_id(page: Page) -> str:
    return page.locator("#params dd").first.text_content()


def download(live, video_id: str) -> bytes:
    response = httpx.get(f"{live.url}/v1/videos/{video_id}/content", headers=HEADERS)
    assert response.status_code == 200, response.text
    return response.content


def run_snippet(command: list[str], cwd) -> None:
    env = {**os.environ, "H3SERVE_API_KEY": API_KEY}
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr


def copied(page: Page, button: str) -> str:
    page.get_by_role("button", name=button).click()
    expect(page.locator("#copy-status")).to_contain_text("copied")
    return page.evaluate("navigator.clipboard.readText()")


def drop_file(page: Page, selector: str, name: str, data: bytes, mime: str) -> None:
    """A file dragged from the desktop onto `selector`: dragover, then drop, with a real DataTransfer."""
    transfer = page.evaluate_handle(
        """([b64, name, mime]) => {
            const bytes = Uint8Array.from(atob(b64), c => c.charCodeAt(0));
            const transfer = new DataTransfer();
            transfer.items.add(new File([bytes], name, { type: mime }));
            return transfer;
        }""",
        [base64.b64encode(data).decode(), name, mime],
    )
    page.dispatch_event(selector, "dragover", {"dataTransfer": transfer})
    page.dispatch_event(selector, "drop", {"dataTransfer": transfer})


def assert_no_serious_violations(page: Page) -> None:
    """axe-core in the page: no critical (nor serious) accessibility violations."""
    results = Axe().run(page)
    bad = [v for v in results.response["violations"] if v["impact"] in ("critical", "serious")]
    assert not bad, results.generate_report()


def test_t2va_reaches_100_percent_and_the_copied_curl_line_reproduces_the_mp4(page, live, screenshots, tmp_path):
    prompt = "A red fox trots through fresh snow at dawn,\nits paws crunching 'softly'."
    fill(page, prompt)
    expect(page.locator("#seconds-info")).to_have_text(f"4 s → {FRAMES_4S} frames, 4.46 s")
    expect(page.locator("#canvas-info")).to_have_text("128×64 px (default 16:9)")  # the tiny checkpoint's canvas
    # The line break travels as CRLF (as browsers send form fields), and counts as two characters on the server.
    expect(page.locator("#prompt-count")).to_have_text(f"{len(prompt) + 1} / 7,000 characters")
    page.evaluate("""() => {
        window.stages = [];
        const stage = document.getElementById("job-stage");
        new MutationObserver(() => window.stages.push(stage.textContent)).observe(stage, { childList: true });
    }""")
    generate_and_wait(page)
    stages = list(dict.fromkeys(page.evaluate("window.stages")))  # in order, without repeats
    assert stages[-2:] == ["Decoding video and audio, muxing the MP4", "Done"], stages
    assert "Encoding the prompt and inputs" in stages, stages
    duration = page.evaluate("document.getElementById('player').duration")
    assert duration == pytest.approx(FRAMES_4S / 24, abs=0.02)
    audio_bytes = page.evaluate("""async () => {
        const player = document.getElementById("player");
        player.muted = true;  // headless autoplay rules; the track is decoded all the same
        await player.play();
        await new Promise(resolve => setTimeout(resolve, 800));
        player.pause();
        return player.webkitAudioDecodedByteCount;
    }""")
    assert audio_bytes > 0  # the player has sound
    scrub = page.locator("#scrub-view")
    scrub.scroll_into_view_if_needed()
    box = scrub.bounding_box()
    scrub.hover(position={"x": box["width"] * 0.95, "y": box["height"] / 2})  # near the end
    expect(scrub).to_have_attribute("aria-label", re.compile(r"^Spritesheet frame 10 of 10"))
    assert scrub.evaluate("el => el.style.backgroundPosition") == "100% 100%"
    page.screenshot(path=screenshots / "t2va-result.png", full_page=True)
    assert_no_serious_violations(page)

    video_id = job_id(page)
    served = download(live, video_id)
    curl = copied(page, "Copy as curl")
    assert curl.startswith("curl ") and API_KEY not in curl
    run_snippet(["bash", "-c", curl], tmp_path)
    assert (tmp_path / "h3serve.mp4").read_bytes() == served

    # "use this frame as first frame": a new FL2VA request with the player's frame in the first slot
    page.get_by_role("button", name="Use this frame as first frame").click()
    expect(page.get_by_label("First and last frame")).to_be_checked()
    expect(page.locator("#keyframes .slot[data-slot=first] img")).to_be_visible()
    expect(page.locator("#keyframes .slot[data-slot=first] .field-error")).to_be_empty()
    expect(page.locator("#canvas-info")).to_have_text("128×64 px (first keyframe's aspect)")


def test_fl2va_with_a_first_frame_dropped_on_its_slot(page, live, screenshots, tmp_path):
    page.get_by_label("First and last frame").check()
    drop_file(page, "#keyframes .slot[data-slot=first] .drop", "first.png", png(512, 256), "image/png")
    expect(page.locator("#keyframes .slot[data-slot=first] img")).to_have_attribute("alt", "first frame: first.png")
    expect(page.locator("#keyframes .slot[data-slot=first]")).to_contain_text("512×256")
    fill(page, "The fox looks up")
    generate_and_wait(page)
    expect(page.locator("#params")).to_contain_text("input_reference")
    page.screenshot(path=screenshots / "fl2va-result.png", full_page=True)
    python = copied(page, "Copy as Python (openai SDK)")
    assert 'input_reference=open("first.png", "rb")' in python
    (tmp_path / "first.png").write_bytes(png(512, 256))
    run_snippet([sys.executable, "-c", python], tmp_path)
    assert (tmp_path / "h3serve.mp4").read_bytes() == download(live, job_id(page))


def test_ref2va_with_an_image_and_an_audio_clip(page, live, screenshots, tmp_path):
    page.get_by_label("References", exact=True).check()
    files = [
        {"name": "voice.wav", "mimeType": "audio/wav", "buffer": wav(2.5)},
        {"name": "singer.png", "mimeType": "image/png", "buffer": png(256, 320, (30, 120, 200))},
    ]
    page.get_by_label("Reference files").set_input_files(files)
    items = page.locator("#ref-list li")
    expect(items).to_have_count(2)
    expect(items.nth(0)).to_contain_text("voice.wav — audio")
    expect(items.nth(0)).to_contain_text("2.50 s")
    page.get_by_role("button", name="Down: voice.wav").click()  # order matters: the image first
    expect(items.nth(0)).to_contain_text("singer.png — image")
    expect(page.locator("#ref-counts")).to_have_text("(1/9 images, 0/3 videos, 1/3 audio)")
    fill(page, "She sings on a stage")
    assert_no_serious_violations(page)
    generate_and_wait(page)
    page.screenshot(path=screenshots / "ref2va-result.png", full_page=True)

    python = copied(page, "Copy as Python (openai SDK)")
    assert '[("input_references", open("singer.png", "rb")), ("input_references", open("voice.wav", "rb"))]' in python
    for spec in files:
        (tmp_path / spec["name"]).write_bytes(spec["buffer"])
    run_snippet([sys.executable, "-c", python], tmp_path)
    assert (tmp_path / "h3serve.mp4").read_bytes() == download(live, job_id(page))


def test_the_ready_examples_fill_the_form(page, live, screenshots):
    """The demo world's examples (h3serve/api/static/examples): one click puts an example's keyframes or references
    in their slots as chosen files (the page's own checks pass them; the server's intake takes them:
    tests/demo/test_web_examples.py), with its task, prompt, duration and seed."""
    expect(page.locator("#example-list button")).to_have_count(7)
    page.get_by_role("button", name="First and last frames: a yellow square moving up").click()
    expect(page.get_by_label("First and last frame")).to_be_checked()
    for slot in ("first", "last"):
        expect(page.locator(f"#keyframes .slot[data-slot={slot}] img")).to_have_attribute(
            "alt", f"{slot} frame: fl2va_both_drawn-7-{slot}.png")
    expect(page.get_by_label("Prompt")).to_have_value("a yellow square moving up, with a high beep")
    expect(page.locator("#seconds")).to_have_value("4")
    expect(page.locator("#seed")).to_have_value("7")  # the eval-demo case's
    page.screenshot(path=screenshots / "examples-fl2va.png", full_page=True)

    page.get_by_role("button", name="Reference image and sound: a ball moving right").click()
    expect(page.get_by_label("References", exact=True)).to_be_checked()
    items = page.locator("#ref-list li")
    expect(items).to_have_count(2)
    expect(items.nth(0)).to_contain_text("ref2va-1-image.png — image")
    expect(items.nth(1)).to_contain_text("ref2va-1-sound.wav — audio")
    expect(page.get_by_label("Prompt")).to_have_value(
        "the ball from the reference image moving right, with the reference sound")
    expect(page.locator("#keyframes .slot img")).to_have_count(0)  # the FL2VA example's keyframes are gone
    expect(page.get_by_role("button", name="Reference image and sound: a ball moving right")).to_have_attribute(
        "aria-pressed", "true")
    expect(page.locator("#seed")).to_have_value("1")
    expect(page.locator("#ref-list .field-error:not(:empty)")).to_have_count(0)  # within the page's media limits
    page.screenshot(path=screenshots / "examples-ref2va.png", full_page=True)


def jobs(live) -> list[dict]:
    response = httpx.get(f"{live.url}/v1/videos?limit=100", headers=HEADERS)
    return response.json()["data"]


SIZE_REFUSAL = "size: must be between 32 and 4096 pixels, got 20"  # the server's own words


def test_invalid_inputs_show_the_servers_message_by_the_field(page, live, screenshots, tmp_path):
    fill(page, "too many steps", {**FAST, "#steps": "500"})
    page.get_by_role("button", name="Generate").click()
    error = page.locator("#steps-error")
    expect(error).to_have_text("num_inference_steps: must be between 1 and 200, got 500")
    expect(page.locator("#steps")).to_have_attribute("aria-invalid", "true")
    expect(page.locator("#steps")).to_be_focused()
    page.screenshot(path=screenshots / "invalid-steps.png", full_page=True)

    # An explicit size: the page computes the canvas by the server's rules, and shows the server's refusal.
    page.fill("#steps", "1")
    page.get_by_label("Canvas").select_option("size")
    expect(page.locator("#canvas-info")).to_have_text("128×64 px (explicit size)")  # starts at the default canvas
    page.get_by_label("Width in pixels").fill("100")  # floored to the grid, as the server does
    expect(page.locator("#canvas-info")).to_have_text("96×64 px (explicit size, floored to multiples of 32)")
    page.get_by_label("Width in pixels").fill("20")  # below one grid step: refused
    expect(page.locator("#canvas-info")).to_have_text("width: must be between 32 and 4096 pixels")
    page.get_by_role("button", name="Generate").click()
    expect(page.locator("#size-error")).to_have_text(SIZE_REFUSAL)
    expect(page.locator("#width")).to_have_attribute("aria-invalid", "true")
    page.get_by_label("Width in pixels").fill("128")
    page.get_by_label("Canvas").select_option("aspect")

    # A file the browser cannot decode goes to the server, whose message lands on that reference.
    page.fill("#steps", "1")
    page.get_by_label("References", exact=True).check()
    broken = png(256, 256)[:40] + b"\0" * 200
    page.get_by_label("Reference files").set_input_files(
        [{"name": "broken.png", "mimeType": "image/png", "buffer": broken}])
    page.get_by_role("button", name="Generate").click()
    expect(page.locator("#ref-list li").first.locator(".field-error")).to_contain_text(
        "input_references[0] ('broken.png')")
    expect(page.locator("#steps-error")).to_be_empty()

    # Limits the page checks itself: nothing is sent.
    before = len(jobs(live))
    page.get_by_role("button", name="Remove: broken.png").click()
    page.get_by_label("Reference files").set_input_files(
        [{"name": "short.wav", "mimeType": "audio/wav", "buffer": wav(1.0)}])
    expect(page.locator("#ref-list li").first).to_contain_text("audio is 1.00 s long; each clip must be 2-15 s")
    expect(page.locator("#refs-error")).to_have_text("audio needs at least one image or video beside it")
    page.get_by_role("button", name="Generate").click()
    expect(page.locator("#refs-error")).to_contain_text("audio is 1.00 s long")
    assert len(jobs(live)) == before

    # A video reference: its first frame as the preview, its edges and duration measured in the page.
    video = mp4(tmp_path / "clip.mp4", 3.0)
    page.get_by_label("Reference files").set_input_files(
        [{"name": "clip.mp4", "mimeType": "video/mp4", "buffer": video}])
    clip = page.locator("#ref-list li").nth(1)
    expect(clip).to_contain_text("clip.mp4 — video")
    expect(clip).to_contain_text("320×192 · 3.00 s")
    assert clip.locator("img").get_attribute("src").startswith("data:image/jpeg")
    expect(page.locator("#refs-error")).to_be_empty()  # the audio clip now has a video beside it
    page.locator("#ref-list li").nth(1).drag_to(page.locator("#ref-list li").nth(0))  # reorder by dragging
    expect(page.locator("#ref-list li").nth(0)).to_contain_text("1. clip.mp4")


def test_cancel_a_running_job_shows_steps_and_frees_it(page, live, screenshots):
    fill(page, "a long one", {"#seconds": "15", "#steps": "200", "#seed": "1"})
    page.get_by_role("button", name="Generate").click()
    stage = page.locator("#job-stage")
    expect(stage).to_have_text(re.compile(r"Denoising: step \d+ of 200"), timeout=JOB_TIMEOUT_MS)
    expect(page.locator("#job-times")).to_contain_text("left")
    page.screenshot(path=screenshots / "running.png", full_page=True)
    video_id = page.locator("#jobs li").first.get_attribute("data-id")
    page.get_by_role("button", name="Cancel", exact=True).click()
    expect(stage).to_have_text("Cancelled")
    response = httpx.get(f"{live.url}/v1/videos/{video_id}", headers=HEADERS)
    assert response.status_code == 404


def test_history_pages_filters_and_deletes(page, live):
    done = httpx.post(f"{live.url}/v1/videos", headers=HEADERS,
                      data={"prompt": "finished", "seconds": "4", "num_inference_steps": "1"}).json()["id"]
    wait_until(lambda: httpx.get(f"{live.url}/v1/videos/{done}", headers=HEADERS).json()["status"] == "completed",
               timeout_s=JOB_TIMEOUT_MS / 1000, what="a completed job", interval_s=0.2)
    # Long jobs: the first runs for the whole test and the others stay queued, so a row's Cancel button cannot
    # turn into Delete under the test's feet (a fast host finished short jobs before the focus check).
    ids = [httpx.post(f"{live.url}/v1/videos", headers=HEADERS,
                      data={"prompt": f"queued {i}", "seconds": "15", "num_inference_steps": "200"}).json()["id"]
           for i in range(11)]
    try:
        page.get_by_role("button", name="Refresh").click()
        rows = page.locator("#jobs li")
        expect(rows).to_have_count(10)
        expect(rows.first).to_contain_text("queued 10")
        page.get_by_role("button", name="Older").click()
        expect(rows.first).to_contain_text("queued 0")
        page.get_by_role("button", name="Newer").click()
        expect(rows.first).to_contain_text("queued 10")
        cancel = page.get_by_role("button", name=f"Cancel job {ids[5]}")
        cancel.focus()
        page.wait_for_timeout(3500)  # the list refreshes every 3 s: the keyboard focus stays where it was
        expect(cancel).to_be_focused()
        page.get_by_label("Show").select_option("completed")
        expect(rows.filter(has_text="queued 10")).to_have_count(0)
        page.get_by_label("Show").select_option("")
        page.get_by_role("button", name="Older").click()
        page.locator(f"#jobs li[data-id={done}]").get_by_role("button", name="Open").click()
        expect(page.locator("#result")).to_be_visible()
        page.wait_for_function("document.getElementById('player').readyState >= 1")
        expect(page.get_by_role("button", name="Copy as curl")).to_be_disabled()  # sent from another tab
        page.get_by_role("button", name="Newer").click()
        page.get_by_role("button", name=f"Cancel job {ids[-1]}").click()
        expect(rows.first).not_to_contain_text("queued 10")
        assert httpx.get(f"{live.url}/v1/videos/{ids[-1]}", headers=HEADERS).status_code == 404
    finally:
        for video_id in ids:
            httpx.delete(f"{live.url}/v1/videos/{video_id}", headers=HEADERS)


def test_phone_width_keyboard_and_accessibility(browser, live, screenshots):
    page = open_page(browser, live.url, width=390, height=844)
    try:
        for task in ("Text only", "First and last frame", "References"):
            page.get_by_label(task, exact=True).check()
            assert page.evaluate("document.documentElement.scrollWidth <= window.innerWidth"), task
            assert_no_serious_violations(page)
        page.screenshot(path=screenshots / "phone.png", full_page=True)

        page.get_by_label("Text only").focus()
        page.keyboard.press("ArrowRight")  # radios move with the arrow keys
        expect(page.get_by_label("First and last frame")).to_be_checked()
        expect(page.locator("#keyframes")).to_be_visible()
        page.get_by_label("Prompt").focus()
        page.keyboard.press("Shift+Tab")  # back to the last frame's file picker: a visible focus ring
        outline = page.evaluate("getComputedStyle(document.activeElement.closest('.button')).outlineStyle")
        assert outline == "solid"
    finally:
        close_page(page)


def test_the_page_computes_frames_and_canvas_by_the_servers_rules(page):
    """rules.js against h3serve.rules.geometry, over every half second and many aspect ratios and checkpoints."""
    from h3serve.rules import geometry

    durations = [4 + i / 4 for i in range(45)] + [4.01, 5.0, 7.3, 14.99]
    aspects = [(16, 9), (9, 16), (1, 1), (4, 3), (21, 9), (4, 1), (1, 4), (2.35, 1), (512, 256), (1000, 999)]
    checkpoints = [(768, 1_032_192), (64, 64 * 128), (256, 448 * 256), (720, 921_600)]
    result = page.evaluate(
        """async ([durations, aspects, checkpoints]) => {
            const rules = await import("/web/static/js/rules.js");
            const config = await (await fetch("/web/config")).json();
            const frames = durations.map(d => rules.framesForDuration(d, config.limits));
            const canvases = checkpoints.flatMap(([short, pixels]) => aspects.map(([w, h]) => {
                const defaults = { canvas_short_edge: short, canvas_max_pixels: pixels };
                const c = rules.canvasForAspect(w, h, defaults, config.limits);
                return [c.height, c.width];
            }));
            return { frames, canvases };
        }""",
        [durations, aspects, checkpoints],
    )
    assert result["frames"] == [geometry.frames_for_duration(d) for d in durations]
    expected = [list(geometry.resolve_canvas_size(w, h, short, pixels)) for short, pixels in checkpoints
                for w, h in aspects]
    assert result["canvases"] == expected


def test_static_files_and_config(live):
    assert httpx.get(f"{live.url}/web/static/js/main.js").headers["content-type"].startswith("text/javascript")
    for name in ("..%2Froutes%2Fweb.py", "..%2F..%2Fapi%2Fapp.py", "js/missing.js", "js"):  # files outside, none
        assert httpx.get(f"{live.url}/web/static/{name}").status_code == 404, name
    examples = httpx.get(f"{live.url}/web/static/examples/examples.json")
    assert examples.headers["content-type"].startswith("application/json") and examples.json()["examples"]
    assert httpx.get(f"{live.url}/web/static/examples/ref2va-1-sound.wav").headers["content-type"] == "audio/wav"
    config = httpx.get(f"{live.url}/web/config").json()  # no key needed: limits and defaults only
    assert config["api_key_required"] is True and API_KEY not in str(config)
    assert config["limits"]["max_prompt_chars"] == 7000 and config["defaults"]["canvas_short_edge"] == 64


MEDIA_CASES = {  # name -> reference files; each set is judged by the page and by the server's intake
    "image 256x256": [("a.png", lambda d: png(256, 256))],
    "image edge 255": [("a.png", lambda d: png(255, 300))],
    "image 5:2": [("a.png", lambda d: png(640, 256))],
    "image past 5:2": [("a.png", lambda d: png(642, 256))],
    "audio 2 s with an image": [("a.png", lambda d: png(256, 256)), ("a.wav", lambda d: wav(2.0))],
    "audio 1.9 s with an image": [("a.png", lambda d: png(256, 256)), ("a.wav", lambda d: wav(1.9))],
    "audio 15.2 s with an image": [("a.png", lambda d: png(256, 256)), ("a.wav", lambda d: wav(15.2, rate=8000))],
    "audio 16 s in two clips": [("a.png", lambda d: png(256, 256)), ("a.wav", lambda d: wav(8, rate=8000)),
                                ("b.wav", lambda d: wav(8, rate=8000))],
    "audio alone": [("a.wav", lambda d: wav(2.5))],
    "ten images": [(f"{i}.png", lambda d: png(256, 256)) for i in range(10)],
    "video 3 s": [("a.mp4", lambda d: mp4(d / "a.mp4", 3.0))],
    "video 1.5 s": [("a.mp4", lambda d: mp4(d / "a.mp4", 1.5))],
}


def test_the_pages_media_checks_agree_with_the_servers_intake(page, tmp_path):
    from h3serve.media.media_inputs import MediaError, check_references
    from h3serve.rules.request import MediaRef

    sets = {}
    server = {}
    for case, files in MEDIA_CASES.items():
        folder = tmp_path / case.replace(" ", "-").replace(":", "")
        folder.mkdir()
        refs = []
        for name, make in files:
            (folder / name).write_bytes(make(folder))
            refs.append(MediaRef(folder / name, name))
        sets[case] = [[name, base64.b64encode((folder / name).read_bytes()).decode()] for name, _ in files]
        try:
            check_references(refs)
            server[case] = True
        except MediaError:
            server[case] = False
    page_verdicts = page.evaluate(
        """async sets => {
            const { probeFile } = await import("/web/static/js/media.js");
            const rules = await import("/web/static/js/rules.js");
            const { media } = await (await fetch("/web/config")).json();
            const verdicts = {};
            for (const [name, files] of Object.entries(sets)) {
                const infos = await Promise.all(files.map(([file, b64]) =>
                    probeFile(new File([Uint8Array.from(atob(b64), c => c.charCodeAt(0))], file))));
                const problems = [...infos.flatMap(i => rules.mediaProblems(i, media)),
                                  ...rules.referenceSetProblems(infos, media)];
                verdicts[name] = problems.length === 0;
            }
            return verdicts;
        }""",
        sets,
    )
    accepted = {"image 256x256", "image 5:2", "audio 2 s with an image", "video 3 s"}
    assert server == {case: case in accepted for case in MEDIA_CASES}
    assert page_verdicts == server


def _job_with_prompt(live, prompt: str) -> dict | None:
    """The newest listed job with this prompt, or None."""
    jobs = httpx.get(f"{live.url}/v1/videos", headers=HEADERS).json()["data"]
    return next((j for j in jobs if j["prompt"] == prompt), None)


def test_long_video_continuation_from_the_page(page, live):
    """Long video options: the duration cap follows the mode, window prompts go in extra_params; the 40 s job
    is accepted (974 frames) and then deleted (cancelled) rather than waited for."""
    fill(page, "a sailboat on a calm sea", {"#seconds": "40", "#steps": "1"})
    expect(page.locator("#seconds-info")).to_have_text("between 4 and 15 s")
    expect(page.locator("#window-prompts-field")).to_be_hidden()
    page.select_option("#long-mode", "continuation")
    expect(page.locator("#seconds-info")).to_have_text("40 s → 974 frames, 40.58 s")
    page.fill("#window-prompts", "at dawn\na storm gathers\nlightning\nthe storm clears")
    page.get_by_role("button", name="Generate").click()
    job = wait_until(lambda: _job_with_prompt(live, "a sailboat on a calm sea"), 60, "the job", 0.2)
    assert (job["seconds"], job["num_frames"]) == ("40", 974)
    assert httpx.delete(f"{live.url}/v1/videos/{job['id']}", headers=HEADERS).status_code == 200


def test_the_solver_select_lists_the_servers_solvers_and_sends_the_choice(page, live):
    """The select offers /web/config's solvers (euler first, the default, which the request leaves out); the
    chosen res_multistep travels as extra_params.sample_solver and is shown with the result."""
    names = httpx.get(f"{live.url}/web/config").json()["names"]["sample_solvers"]
    assert page.locator("#sample_solver option").all_text_contents() == names == ["euler", "res_multistep"]
    expect(page.get_by_label("Solver")).to_have_value("euler")
    fill(page, "a paper boat on a puddle", {**FAST, "#steps": "3"})
    page.get_by_label("Solver").select_option("res_multistep")
    generate_and_wait(page)
    expect(page.locator("#params")).to_contain_text('extra_params.sample_solver"res_multistep"')

def test_several_outputs_show_as_a_gallery(page, live):
    """Outputs 2: the request carries num_outputs_per_prompt, the result shows a gallery of both thumbnails, and
    picking #1 puts output 1 (the server's index=1 file) in the player and the download link. With a webhook
    endpoint, the job sends one event for its two outputs, and the page shows that delivery."""
    with receiver() as rx:
        hook = httpx.post(f"{live.url}/v1/webhook_endpoints", headers=HEADERS, json={
            "name": "page", "url": rx.url, "event_types": ["video.completed"]}).json()
        try:
            fill(page, "a lantern on a pier", {**FAST, "#num_outputs": "2"})
            generate_and_wait(page)
            row = page.locator("#deliveries-rows tr")
            expect(row).to_have_count(1)
            expect(row).to_have_attribute("data-state", "delivered")
            expect(row.locator("td")).to_have_text([hook["id"], "video.completed", "delivered", "1",
                                                    re.compile(r"^HTTP 200 at ")])
            [event] = rx.wait_for(1)
            assert json.loads(event.body)["data"]["id"] == job_id(page)
        finally:
            httpx.delete(f"{live.url}/v1/webhook_endpoints/{hook['id']}", headers=HEADERS)
    expect(page.locator("#params")).to_contain_text("num_outputs_per_prompt2")
    gallery = page.get_by_role("group", name="Outputs of this job").get_by_role("button")
    expect(gallery).to_have_count(2)
    expect(gallery.nth(0)).to_have_attribute("aria-pressed", "true")
    gallery.nth(1).click()
    expect(gallery.nth(1)).to_have_attribute("aria-pressed", "true")
    expect(page.locator("#download")).to_have_attribute("download", f"{job_id(page)}-1.mp4")
    shown = page.evaluate("fetch(document.getElementById('download').href).then(r => r.arrayBuffer())"
                          ".then(b => Array.from(new Uint8Array(b)).slice(0, 4096))")
    one = httpx.get(f"{live.url}/v1/videos/{job_id(page)}/content?index=1", headers=HEADERS).content
    assert bytes(shown) == one[:4096] and one != download(live, job_id(page))


def test_the_control_box_sends_the_type_and_shows_the_servers_refusal_by_it(page, live):
    """The ControlNet box lists /web/config's control types; the type goes out as extra_params.canny and the
    server's 400 lands on the box's error line (this server loads no ControlNet: refused at intake, naming it)."""
    names = httpx.get(f"{live.url}/web/config").json()["names"]["control_types"]
    assert page.locator("#control-type option").all_text_contents() == ["none", *names]
    fill(page, "a lantern on a pier")
    page.locator("#control-box summary").click()
    page.select_option("#control-type", "canny")
    page.get_by_role("button", name="Generate").click()
    expect(page.locator("#control-error")).to_contain_text("extra_params.canny: this server serves no ControlNet")


def test_extend_a_result(page, live):
    """The result's Extend button: POST /v1/videos/extensions with the shown job's id; the new job is the source
    (4 s, 107 frames) followed by 102 more frames, and the page follows it to the end."""
    fill(page, "a kite over a hill")
    generate_and_wait(page)
    source = job_id(page)
    page.fill("#prompt", "the kite climbs higher")
    page.get_by_role("button", name="Extend").click()
    job = wait_until(lambda: _job_with_prompt(live, "the kite climbs higher"), 60, "the extension job", 0.2)
    assert job["num_frames"] == FRAMES_4S + 102 and job["id"] != source
    expect(page.locator("#job-stage")).to_have_text("Done", timeout=JOB_TIMEOUT_MS)
    assert httpx.get(f"{live.url}/v1/videos/{job['id']}", headers=HEADERS).json()["status"] == "completed"


def test_latent_mask_edit_from_the_page(page, live, tmp_path):
    """A source video and an all-0 mask: the job keeps the source (a latent-mask edit) and completes."""
    source = tmp_path / "source.mp4"
    source.write_bytes(mp4(tmp_path / "made.mp4", 4.5))
    fill(page, "keep it as it is")
    page.locator("#edit-box summary").click()
    page.set_input_files("#source-video", str(source))
    page.fill("#video-mask", "[1.5]")
    page.get_by_role("button", name="Generate").click()
    expect(page.locator("#video_noise_mask-error")).to_contain_text("values must be in [0, 1]")
    page.fill("#video-mask", "0")
    generate_and_wait(page)


def test_timeline_guides_on_the_track_checked_and_sent(page, live, screenshots):
    """Guides on the timeline: an image at frame 36 (typed), a sound from a click near the track's end; a frame
    outside the output is refused by the guide's own line before anything is sent; the job runs with the manifest
    and one guide_files upload per guide (as the copied curl line shows)."""
    fill(page, "a lantern swings in the wind")
    page.locator("#guide-box summary").click()
    page.fill("#guide-frame", "36")
    page.get_by_label("Guide file").set_input_files(
        [{"name": "lantern.png", "mimeType": "image/png", "buffer": png(96, 64, (220, 180, 40))}])
    track = page.locator("#guide-track")
    box = track.bounding_box()
    track.click(position={"x": box["width"] - 2, "y": box["height"] / 2})  # the last frame
    expect(page.locator("#guide-frame")).to_have_value(str(FRAMES_4S - 1))
    page.get_by_label("Guide file").set_input_files([{"name": "wind.wav", "mimeType": "audio/wav", "buffer": wav(1)}])
    markers = page.locator(".guide-marker")
    expect(markers).to_have_count(2)
    expect(markers.nth(0)).to_have_attribute("aria-label", "Guide 1: image at frame 36")
    left = markers.nth(0).evaluate("el => el.offsetLeft")
    assert left == pytest.approx(box["width"] * 36 / FRAMES_4S, abs=2)  # at frame 36's place on the track
    expect(page.locator("#guide-count")).to_have_text("(2 of at most 8)")

    frame = page.get_by_label("Guide 1 frame (negative: from the end)")
    frame.fill("107")
    frame.dispatch_event("change")
    first = page.locator("#guide-list li").nth(0)
    expect(first.locator(".field-error")).to_have_text("frame 107 places 1 frame at 107..107, outside the output's "
                                                       "frames 0..106")
    before = len(jobs(live))
    page.get_by_role("button", name="Generate").click()
    expect(first.locator(".field-error")).to_contain_text("guide 1: frame 107 places")
    assert len(jobs(live)) == before  # refused in the page
    frame = page.get_by_label("Guide 1 frame (negative: from the end)")
    frame.fill("-71")  # the same frame 36, counted from the end
    frame.dispatch_event("change")
    expect(page.locator("#guide-list li").nth(0).locator(".field-error")).to_be_empty()
    page.locator("#guide-box").screenshot(path=screenshots / "guides.png")
    assert_no_serious_violations(page)
    generate_and_wait(page)
    curl = copied(page, "Copy as curl")
    manifest = '[{"frame_index":-71,"image":{"upload_index":0}},{"frame_index":106,"audio":{"upload_index":1}}]'
    assert f"timeline_guides={manifest}" in curl
    assert "-F 'guide_files=@lantern.png' -F 'guide_files=@wind.wav'" in curl
