"""Issue 20: the request shapes vLLM-Omni's own H3 tests send to /v1/videos, through the real HTTP server (app,
store, job manager and MP4 writer on the fake engine, whose canvas is the tiny checkpoint's: 64 high, 8192
pixels), each MP4's size read back with ffprobe; and the `model` field."""

from __future__ import annotations

import json
import subprocess

import httpx
import pytest
from test_http_api import assert_error, multipart, png, wait_finished

STEPS = {"num_inference_steps": "1"}


@pytest.fixture
def client(fake_server):
    with fake_server.client() as c:
        yield c


def ffprobe_size(data: bytes, tmp_path) -> str:
    path = tmp_path / "out.mp4"
    path.write_bytes(data)
    out = subprocess.run(["ffprobe", "-v", "error", "-select_streams", "v:0", "-show_entries",
                          "stream=width,height", "-of", "json", str(path)], capture_output=True, check=True, text=True)
    stream = json.loads(out.stdout)["streams"][0]
    return f"{stream['width']}x{stream['height']}"


def generated(client: httpx.Client, tmp_path, fields: dict, files: list | None = None) -> tuple[dict, str]:
    """Create the job as a multipart form (vLLM-Omni's encoding), wait, and ffprobe its MP4: (job, WxH)."""
    response = client.post("/v1/videos", files=multipart({"seconds": "4", **STEPS, **fields}, files))
    assert response.status_code == 200, response.text
    job = wait_finished(client, response.json()["id"])
    assert job["status"] == "completed", job["error"]
    return job, ffprobe_size(client.get(f"/v1/videos/{job['id']}/content").content, tmp_path)


def test_width_height_with_the_same_aspect_ratio_is_accepted(client, fake_server, tmp_path):
    """vLLM-Omni's H3 serving tests send width=1344, height=768 and extra_params.aspect_ratio 16:9 together: accepted
    and planned as given (the job is deleted: encoding 1344x768 frames would cost this suite half a minute); the
    same shape at the tiny scale is generated and probed."""
    fields = {"prompt": "p", "width": "1344", "height": "768", "extra_params": {"aspect_ratio": "16:9", "task": "t2va"}}
    fake_server.executor.step_s = 1.0  # its one step outlasts the delete: no MP4 is written
    try:
        response = client.post("/v1/videos", files=multipart({"seconds": "4", **STEPS, **fields}))
        assert response.status_code == 200 and response.json()["size"] == "1344x768", response.text
        assert client.delete(f"/v1/videos/{response.json()['id']}").status_code == 200
    finally:
        fake_server.executor.step_s = 0.01
    job, size = generated(client, tmp_path, {**fields, **STEPS, "width": "256", "height": "128"})
    assert job["size"] == size == "256x128"
    job, size = generated(client, tmp_path, {"prompt": "p", "size": "300x180", "aspect_ratio": "16:9"})
    assert job["size"] == size == "288x160"  # floored to multiples of 32; 16:9 agrees with it


def test_a_conflicting_pair_is_400_naming_both(client):
    response = client.post("/v1/videos", files=multipart({"prompt": "p", "size": "1024x1024",
                                                          "extra_params": {"aspect_ratio": "16:9"}}))
    message = assert_error(response, 400, "invalid_value", "extra_params.aspect_ratio")
    assert message.startswith("extra_params.aspect_ratio: '16:9'") and "width/height (size) 1024x1024" in message
    response = client.post("/v1/videos", files=multipart({"prompt": "p", "size": "128x64", "short_edge": "1440"}))
    assert "short_edge: 1440 conflicts with width/height (size) 128x64" in assert_error(
        response, 400, "invalid_value", "short_edge")


def test_auto_for_fl2va_follows_the_keyframe(client, tmp_path):
    """vLLM-Omni's FL2VA accuracy test: aspect_ratio auto, one keyframe in input_references, frame_indices [0]."""
    fields = {"prompt": "p", "extra_params": {"task": "fl2va", "aspect_ratio": "auto", "frame_indices": [0]}}
    job, size = generated(client, tmp_path, fields, [("input_references", ("k.png", png(256, 512), "image/png"))])
    assert job["size"] == size == "64x128"  # the keyframe's 1:2 on the tiny canvas


def test_auto_for_ref2va_is_16_9(client, tmp_path):
    fields = {"prompt": "p", "extra_params": {"task": "ref2va", "aspect_ratio": "adaptive"}}
    job, size = generated(client, tmp_path, fields, [("input_references", ("r.png", png(256, 512), "image/png"))])
    assert job["size"] == size == "128x64"


@pytest.mark.parametrize("ratio, expected", [("0.5625", "64x128"), (1.7778, "128x64")])
def test_numeric_and_named_ratios(client, tmp_path, ratio, expected):
    job, size = generated(client, tmp_path, {"prompt": "p", "extra_params": {"aspect_ratio": ratio}})
    assert job["size"] == size == expected


def test_short_edge_modes(client, tmp_path):
    job, size = generated(client, tmp_path, {"prompt": "p", "extra_params": {"target": {"short_edge": 1440,
                                                                                          "aspect_ratio": "16:9"}}})
    assert job["size"] == size == "224x128"  # the tiny checkpoint's 1440 mode (its 768 mode is 128x64)
    job, size = generated(client, tmp_path, {"prompt": "p", "short_edge": "768", "aspect_ratio": "16:9"})
    assert job["size"] == size == "128x64"


def test_model_is_the_served_name_or_absent(client, fake_server):
    listed = client.get("/v1/models").json()["data"][0]["id"]
    assert listed == fake_server.config.served_model_name
    assert client.post("/v1/videos", files=multipart({"prompt": "p", "model": listed, **STEPS})).status_code == 200
    message = assert_error(client.post("/v1/videos", files=multipart({"prompt": "p", "model": "sora-2"})), 400,
                           "model_not_found", "model")
    assert repr(listed) in message and "sora-2" in message


def test_remix_edit_and_extend_check_the_model_too(client, fake_server, tmp_path):
    """The create route's rule holds on the routes that make a job from another video (the body is read first:
    a wrong name is refused before the source is looked up)."""
    listed = fake_server.config.served_model_name
    job, _ = generated(client, tmp_path, {"prompt": "p"})
    remix = f"/v1/videos/{job['id']}/remix"
    assert_error(client.post(remix, json={"prompt": "q", "model": "sora-2"}), 400, "model_not_found", "model")
    for route in ("/v1/videos/edits", "/v1/videos/extensions"):
        form = multipart({"prompt": "q", "model": "sora-2", "video": json.dumps({"id": job["id"]})})
        assert_error(client.post(route, files=form), 400, "model_not_found", "model")
    accepted = client.post(remix, json={"prompt": "q", "model": listed, **STEPS})
    assert accepted.status_code == 200, accepted.text


def test_the_openapi_description_states_the_canvas_rule(client):
    schema = json.dumps(client.get("/openapi.json").json())
    assert "aspect_ratio must describe the same canvas after the flooring" in schema
    assert "auto/adaptive" in schema and "short_edge" in schema
