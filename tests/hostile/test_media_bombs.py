"""Issue 54's audit, rerun: decompression bombs posted as control media, masks and sources (each file made here),
paths the filesystem cannot hold, a control request the server cannot serve. Every one is a 4xx naming the field
at intake, before the job is queued, or an `invalid_media` job error; never a 500, a traceback, a server path, or
a rank asking for gigabytes."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from fake_executor import FakeExecutor
from hostile_media import h264_clip, png_bomb
from hostile_servers import serve
from peak_rss import peak_rss

from h3serve.media.media_inputs import MediaError, MediaLimitError
from h3serve.rank.media_conditioning import control_pixels
from h3serve.rules.request import ControlRequest, GenerationRequest, MediaRef
from h3serve.rules.validate import ModelDefaults, validate

BIG = 4608  # a frame edge over the budget (4608^2 = 21.2 M pixels > 4096 x 2304) that libx264 encodes in ~1 s
SERVED = ModelDefaults(canvas_short_edge=64, canvas_max_pixels=64 * 128, controlnet=True)  # the tiny canvas


@pytest.fixture(scope="module")
def bombs(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("bombs")
    return {
        "big_video": h264_clip(folder / "big.mp4", BIG, BIG),  # a one-frame H.264 file of ~60 KB
        "big_mask": png_bomb(folder / "big_mask.png", 5000, 5000),  # under Pillow's own bomb check (89 M pixels)
        "lying_mask": png_bomb(folder / "lying_mask.png", 20000, 20000, truncated=True),  # ~50 bytes, cut short
        "small_video": h264_clip(folder / "small.mp4", 64, 64, frames=3),
    }


@pytest.fixture(scope="module")
def server(tmp_path_factory, bombs):
    control_dir = tmp_path_factory.mktemp("controls")
    for path in bombs.values():
        (control_dir / path.name).write_bytes(path.read_bytes())
    with serve(tmp_path_factory.mktemp("data"), executor=FakeExecutor(step_s=0.001), control_dir=control_dir,
               max_queue=100) as running:
        yield running


def _post(server, extra: dict, files: list | None = None):
    with server.client() as client:
        return client.post("/v1/videos", data={"prompt": "x", "extra_params": json.dumps(extra)}, files=files)


def _refusal(response, param: str) -> dict:
    assert response.status_code == 400, response.text
    assert response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert error["param"] == param, error
    return error


@pytest.mark.parametrize("upload, extra, part", [
    ("big_video", {"depth": {}}, "control_reference"),
    ("big_mask", {"inpaint": {}}, "mask_reference"),
    ("lying_mask", {"inpaint": {}}, "mask_reference"),
    ("big_video", {"inpaint": {}}, "source_reference"),
])
def test_a_control_upload_over_the_pixel_budget_is_400_at_intake(server, bombs, upload, extra, part):
    """Issue break 1: the 8192^2 one-frame control video was accepted with 200 and asked a rank for 20.1 GiB."""
    files = [(part, (bombs[upload].name, bombs[upload].read_bytes(), "application/octet-stream"))]
    if part == "source_reference":  # a source needs a mask
        files.append(("mask_reference", ("m.mp4", bombs["small_video"].read_bytes(), "video/mp4")))
    planned = len(server.executor.plans)
    error = _refusal(_post(server, extra, files), part)
    assert error["code"] == "invalid_media"
    assert "9,437,184 pixels" in error["message"], error  # names the limit
    assert len(server.executor.plans) == planned  # nothing was queued


def test_a_control_path_over_the_pixel_budget_is_400_at_intake(server, bombs):
    error = _refusal(_post(server, {"canny": {"control_path": bombs["big_video"].name}}),
                     "extra_params.canny.control_path")
    assert error["code"] == "invalid_media" and f"{BIG}x{BIG} px" in error["message"]


@pytest.mark.parametrize("extra, param", [
    ({"canny": {"control_path": "a" * 300}}, "extra_params.canny.control_path"),
    ({"canny": {"control_path": "d/" + "b" * 256 + "/x.mp4"}}, "extra_params.canny.control_path"),
    ({"inpaint": {"mask_path": "é" * 200}}, "extra_params.inpaint.mask_path"),  # 400 bytes of UTF-8
])
def test_a_path_component_over_the_filesystems_limit_is_400(server, extra, param):
    """Issue break 3: Path.is_file raised ENAMETOOLONG and the request answered 500."""
    error = _refusal(_post(server, extra), param)
    assert "bytes" in error["message"] and "255" in error["message"]


def test_a_static_file_name_the_filesystem_cannot_hold_is_a_404(server):
    with server.client() as client:
        response = client.get(f"/web/static/{'a' * 300}.js")
    assert response.status_code == 404 and response.json()["error"]["code"] == "file_not_found"


def test_a_control_request_the_server_cannot_serve_is_400_at_intake(server, bombs):
    files = [("control_reference", ("c.mp4", bombs["small_video"].read_bytes(), "video/mp4"))]
    executor = server.executor
    try:
        executor.defaults = dataclasses.replace(executor.defaults, controlnet=False)
        error = _refusal(_post(server, {"depth": {}}, files), "extra_params.depth")
        assert "--controlnet-model-path" in error["message"]
    finally:
        executor.defaults = dataclasses.replace(executor.defaults, controlnet=True)
    with server.client() as client:  # a `data:,` control reference: an empty file, refused by its bytes
        response = client.post("/v1/videos", json={"prompt": "x", "extra_params": {"depth": {}},
                                                   "control_reference": "data:,"})
    assert _refusal(response, "control_reference")["code"] == "invalid_media"


def test_a_long_id_is_not_echoed_whole(server):
    with server.client() as client:
        response = client.post("/v1/videos/edits", json={"prompt": "x", "video": {"id": "v" * 60_000}})
    assert response.status_code == 404 and len(response.text) < 400, response.text[:200]


# -- the rank's side -----------------------------------------------------------------------------------------


def _plan(**control):
    return validate(GenerationRequest(prompt="x", duration_s=4, steps=1,
                                      control=ControlRequest(**control)), SERVED)


@pytest.mark.parametrize("mask", ["lying_mask", "big_mask"])
def test_a_mask_bomb_in_the_rank_is_invalid_media_not_a_crash(bombs, mask):
    """Issue break 2: the truncated 20000^2 PNG failed the job as `generation_failed` (DecompressionBombError)."""
    plan = _plan(type="inpaint", mask=MediaRef(bombs[mask], "mask.png"))
    with pytest.raises(MediaLimitError) as refused:
        control_pixels(plan)
    assert refused.value.code == "invalid_media" and refused.value.field == "extra_params.inpaint.mask_path"
    assert str(bombs[mask]) not in str(refused.value)


def test_a_corrupt_control_video_names_no_server_path(bombs, tmp_path):
    """Job errors used to carry FFmpeg's message with the absolute input path (.../jobs/<id>/inputs/00-x.mp4)."""
    broken = tmp_path / "broken.mp4"
    broken.write_bytes(bombs["small_video"].read_bytes()[:48])  # its `ftyp` box and nothing FFmpeg can read
    plan = _plan(type="canny", control=MediaRef(broken, "clip.mp4"))
    with pytest.raises(MediaError) as refused:
        control_pixels(plan)
    top = tmp_path.anchor + tmp_path.parts[1]  # "/tmp": no piece of the server's path, even cut short
    assert refused.value.code == "invalid_media" and top not in str(refused.value), refused.value


def test_a_small_file_of_a_large_canvas_costs_the_rank_one_frame(tmp_path):
    """The issue's 1.7 KB 1024^2 one-frame control video raised the rank's peak RSS by 1.6 GiB: its frame was held
    for all 107 output frames at the source size, then copied to float32. Now each frame goes onto the canvas as it
    is decoded: the rank holds the canvas-sized tensor and one source frame (scripts/control_media_rss.py measures
    every bomb file in a fresh process: docs/reliability.md)."""
    clip = h264_clip(tmp_path / "k1024.mp4", 1024, 1024)
    assert control_pixels(validate(GenerationRequest(prompt="x", duration_s=4, steps=1), SERVED)) is None
    plan = _plan(type="depth", control=MediaRef(clip, "k1024.mp4"))
    control_pixels(plan)  # once for the decoder's own one-time allocations
    with peak_rss() as peak:
        pixels = control_pixels(plan)
    print(f"FIGURE rank peak RSS, 1024x1024 one-frame control video on the tiny canvas: +{peak.grown_mib:.0f} MiB")
    assert pixels.control.shape == (1, 3, 107, 64, 128)
    assert peak.grown_mib < 64  # one 1024^2 frame as float32 is 12 MiB; held for 107 frames at its size, 1.3 GiB
