"""Timeline guides over HTTP (vLLM-Omni's request) on the fake engine: the `timeline_guides` manifest with repeated
`guide_files` uploads on /v1/videos and /v1/videos/sync, its JSON form (URL sources), and every refusal a 400 that
names the entry and the rule, before anything is queued."""

from __future__ import annotations

import base64
import io
import json
import math
import struct
import wave

import openai
import pytest
from api_servers import API_KEY
from PIL import Image
from waiting import wait_until

REQUEST = {"prompt": "waves on a beach", "size": "128x64", "seconds": "4", "num_inference_steps": 2, "seed": 5}


@pytest.fixture
def client(fake_server):
    with fake_server.client() as c:
        yield c


def png(width: int = 96, height: int = 64) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (width, height), (200, 80, 20)).save(buf, format="PNG")
    return buf.getvalue()


def wav(seconds: float = 0.5, rate: int = 16_000) -> bytes:
    samples = b"".join(struct.pack("<h", int(8000 * math.sin(2 * math.pi * 440 * i / rate)))
                       for i in range(int(seconds * rate)))
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(samples)
    return out.getvalue()


def form(fields: dict, manifest: list | None, files: list[tuple[str, bytes]]) -> list:
    parts = [(k, (None, v if isinstance(v, str) else json.dumps(v))) for k, v in fields.items()]
    if manifest is not None:
        parts.append(("timeline_guides", (None, json.dumps(manifest))))
    return parts + [("guide_files", (name, data)) for name, data in files]


def planned(fake_server, prompt: str):
    """The plan the engine ran for `prompt` (waiting for the job to start)."""
    def find():
        return next((p for p in fake_server.executor.plans if p.prompt == prompt), None)

    return wait_until(find, 10, f"a job for {prompt!r}", 0.02)


def error(response, param: str | None) -> str:
    assert response.status_code == 400, response.text
    body = response.json()["error"]
    assert body["param"] == param, body
    assert "Traceback" not in body["message"] and "/tmp" not in body["message"]
    return body["message"]


def test_a_manifest_with_uploads_places_each_guide_on_the_plan(client, fake_server):
    manifest = [
        {"frame_index": 36, "image": {"upload_index": 0}},
        {"frame_index": -1, "image": {"upload_index": 0}},  # the same upload again: stored once
        {"frame_index": 12, "audio": {"upload_index": 1}},
    ]
    response = client.post("/v1/videos", files=form(REQUEST, manifest, [("a.png", png()), ("tone.wav", wav())]))
    assert response.status_code == 200, response.text
    video_id = response.json()["id"]
    plan = planned(fake_server, REQUEST["prompt"])
    assert [(g.start, g.frames, g.audio_latents) for g in plan.guides] == [(36, 1, 0), (106, 1, 0), (12, 0, 20)]
    assert plan.guides[0].visual.path == plan.guides[1].visual.path  # one stored file
    assert plan.guides[2].audio.kind == "audio" and plan.guides[0].visual.kind == "image"
    assert len(list(fake_server.files.inputs_dir(video_id).iterdir())) == 2
    assert client.get(f"/v1/videos/{video_id}").json()["status"] in ("queued", "in_progress", "completed")


def test_sync_takes_guides_and_a_json_body_takes_them_as_urls(client, fake_server):
    manifest = [{"frame_index": 0, "image": {"upload_index": 0}}]
    response = client.post("/v1/videos/sync", files=form({**REQUEST, "prompt": "a sync guide"}, manifest,
                                                          [("a.png", png())]))
    assert response.status_code == 200 and response.content[4:8] == b"ftyp", response.text
    url = "data:image/png;base64," + base64.b64encode(png()).decode()
    body = {**REQUEST, "prompt": "a json guide", "timeline_guides": [{"frame_index": -22, "image": {"url": url}}]}
    response = client.post("/v1/videos", json=body)
    assert response.status_code == 200, response.text
    plan = planned(fake_server, "a json guide")
    assert (plan.guides[0].start, plan.guides[0].frames) == (85, 1)


def test_an_empty_manifest_without_files_is_a_request_without_guides(client, fake_server):
    response = client.post("/v1/videos", files=form({**REQUEST, "prompt": "no guides"}, [], []))
    assert response.status_code == 200, response.text
    assert planned(fake_server, "no guides").guides == ()


REFUSALS = [  # (manifest, uploads, extra fields, param, phrase)
    ([{"frame_index": 107, "image": {"upload_index": 0}}], ["png"], {}, "timeline_guides[0].frame_index",
     "outside the output's frames 0..106"),
    ([{"frame_index": 1.5, "image": {"upload_index": 0}}], ["png"], {}, "timeline_guides[0].frame_index",
     "must be an integer"),
    ([{"frame_index": 3, "image": {"upload_index": 0}, "video": {"upload_index": 0}}], ["png"], {},
     "timeline_guides[0]", "not both"),
    ([{"frame_index": 3, "image": {"upload_index": 0}, "strength": 1}], ["png"], {}, "timeline_guides[0].strength",
     "unknown field"),
    ([{"frame_index": 3, "image": {"upload_index": 1}}], ["png"], {}, "timeline_guides[0].image.upload_index",
     "does not exist"),
    ([{"frame_index": 3, "image": {"upload_index": 0}}], ["png", "wav"], {}, "guide_files[1]", "not referenced"),
    ([{"frame_index": 3, "audio": {"upload_index": 0}}], ["png"], {}, "timeline_guides[0].audio.upload_index",
     "is an image file, not an audio"),
    ([{"frame_index": 3, "image": {"upload_index": 0}}, {"frame_index": 5, "audio": {"upload_index": 0}}], ["png"],
     {}, "timeline_guides[1].audio.upload_index", "is an image file, not an audio"),
    (None, ["png"], {}, "guide_files", "need a timeline_guides manifest"),
    ([{"frame_index": 3, "image": {"upload_index": 0}}], ["png"], {"quality": "high"}, "timeline_guides",
     "send quality=lossless"),
    ([{"frame_index": 3, "image": {"upload_index": 0}}], ["png"],
     {"extra_params": {"timeline_guides": []}}, "extra_params.timeline_guides", "top-level field"),
    ([{"frame_index": 3, "image": {"upload_index": 0}}], ["png"],
     {"extra_params": {"_minimax_h3_timeline_guides": []}}, "extra_params._minimax_h3_timeline_guides", "reserved"),
]


@pytest.mark.parametrize("manifest, uploads, extra, param, phrase", REFUSALS)
def test_every_refusal_is_a_400_naming_the_entry_and_the_rule(client, fake_server, manifest, uploads, extra, param,
                                                               phrase):
    data = {"png": ("a.png", png()), "wav": ("a.wav", wav())}
    before = len(fake_server.executor.plans)
    response = client.post("/v1/videos", files=form({**REQUEST, **extra}, manifest, [data[u] for u in uploads]))
    assert phrase in error(response, param)
    assert len(fake_server.executor.plans) == before  # nothing ran


def test_a_manifest_that_is_not_json_and_guide_files_as_text_are_refused(client):
    parts = [*form(REQUEST, None, []), ("timeline_guides", (None, "[{"))]
    assert "invalid JSON" in client.post("/v1/videos", files=parts).json()["error"]["message"]
    response = client.post("/v1/videos", json={**REQUEST, "guide_files": "a.png"})
    assert "must be file uploads" in error(response, "guide_files")


def test_a_server_that_serves_no_guides_refuses_them_before_storing_anything(client, fake_server, monkeypatch):
    import dataclasses

    from h3serve.rules.guides import attention_refusal

    sparse = dataclasses.replace(fake_server.executor.defaults, guide_refusal=attention_refusal("FASTVIDEO_VSA"))
    monkeypatch.setattr(fake_server.executor, "defaults", sparse)
    jobs_dir = fake_server.config.jobs_dir
    before = sorted(p.name for p in jobs_dir.iterdir()) if jobs_dir.exists() else []
    manifest = [{"frame_index": 0, "image": {"upload_index": 0}}]
    response = client.post("/v1/videos", files=form(REQUEST, manifest, [("a.png", png())]))
    assert "serves no timeline guides" in error(response, "timeline_guides") and "FASTVIDEO_VSA" in response.text
    assert (sorted(p.name for p in jobs_dir.iterdir()) if jobs_dir.exists() else []) == before
    assert client.post("/v1/videos", files=form({**REQUEST, "prompt": "no guides here"}, [], [])).status_code == 200


def test_the_openai_sdk_and_indexed_form_fields_carry_the_manifest(client, fake_server):
    """The OpenAI SDK: `extra_body={"timeline_guides": json.dumps([...])}` (JSON text, as vLLM-Omni takes it; the SDK
    would flatten a list of objects key by key across entries). A form may also index the entries
    (`timeline_guides[0][frame_index]=-22`): its leaves are text, and the manifest's integers are read there."""
    url = "data:image/png;base64," + base64.b64encode(png()).decode()
    guides = [{"frame_index": -22, "image": {"url": url}}, {"frame_index": 3, "image": {"url": url}}]
    with openai.OpenAI(base_url=f"{fake_server.url}/v1", api_key=API_KEY, max_retries=0) as sdk:
        video = sdk.videos.create(prompt="an sdk guide", seconds="4", size="128x64",
                                  extra_body={"timeline_guides": json.dumps(guides), "num_inference_steps": 2})
    assert video.status in ("queued", "in_progress", "completed")
    assert [(g.start, g.frames) for g in planned(fake_server, "an sdk guide").guides] == [(85, 1), (3, 1)]
    indexed = [(k, (None, v)) for k, v in {**REQUEST, "prompt": "indexed guides"}.items() if isinstance(v, str)]
    indexed += [("timeline_guides[0][frame_index]", (None, "-22")), ("timeline_guides[0][image][upload_index]",
                (None, "0")), ("guide_files", ("a.png", png()))]
    assert client.post("/v1/videos", files=indexed).status_code == 200
    assert planned(fake_server, "indexed guides").guides[0].start == 85
