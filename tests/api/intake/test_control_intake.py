"""The ControlNet control over HTTP: `extra_params.<type>` with paths under --control-dir, or the uploads
control_reference / source_reference / mask_reference; everything else a 400 naming the field, before any read."""

from __future__ import annotations

import json

import pytest
from fake_executor import FakeExecutor
from fastapi.testclient import TestClient
from hostile_media import h264_clip

from h3serve.api.app import create_app
from h3serve.api.intake.request_model import ControlTypes
from h3serve.api.server_config import ServerConfig
from h3serve.engine.jobs import JobManager
from h3serve.jobstore.job_files import JobFiles
from h3serve.jobstore.sqlite import SQLiteJobStore
from h3serve.rules.names import CONTROL_TYPES

MP4 = b"\x00\x00\x00\x18ftypmp42\x00\x00\x00\x00mp42isom" + b"\x00" * 64  # sniffed as MP4, refused before its header


@pytest.fixture(scope="module")
def clip(tmp_path_factory) -> bytes:
    """A real 64x64 H.264 clip: intake reads its header."""
    return h264_clip(tmp_path_factory.mktemp("clip") / "clip.mp4", 64, 64, frames=3).read_bytes()


@pytest.fixture
def app(tmp_path, clip):
    control_dir = tmp_path / "controls"
    control_dir.mkdir()
    (control_dir / "edges.mp4").write_bytes(clip)
    (tmp_path / "secret.mp4").write_bytes(MP4)
    (control_dir / "escape.mp4").symlink_to(tmp_path / "secret.mp4")
    stores = []

    def build(with_dir: bool = True):
        config = ServerConfig(served_model_name="tiny", data_dir=tmp_path / "data",
                              control_dir=control_dir if with_dir else None).validate()
        store = SQLiteJobStore(config.store_path)
        stores.append(store)
        executor = FakeExecutor(step_s=0.001)
        manager = JobManager(executor, store, JobFiles(config.jobs_dir), model_name="tiny")
        return TestClient(create_app(config, manager, store)), executor

    yield build
    for store in stores:
        store.close()


def _plans(executor, count):
    import time

    deadline = time.monotonic() + 10
    while len(executor.plans) < count and time.monotonic() < deadline:
        time.sleep(0.01)
    return executor.plans


def test_the_request_models_control_types_are_the_rules(app):
    assert tuple(ControlTypes.model_fields) == CONTROL_TYPES


def test_a_path_under_the_control_dir_and_an_upload_reach_the_plan(app, tmp_path, clip):
    client, executor = app()
    with client:
        body = {"prompt": "a", "extra_params": {"canny": {"control_path": "edges.mp4", "control_context_scale": 0.5}}}
        assert client.post("/v1/videos", json=body).status_code == 200
        form = {"prompt": "b", "extra_params": json.dumps({"depth": {}})}
        files = [("control_reference", ("d.mp4", clip, "video/mp4"))]
        assert client.post("/v1/videos", data=form, files=files).status_code == 200
        first, second = _plans(executor, 2)
    assert first.control.type == "canny" and first.control.scale == 0.5
    assert first.control.control.path == (tmp_path / "controls" / "edges.mp4").resolve()
    assert second.control.type == "depth" and second.control.control.path.is_file() and second.control.scale == 1.0
    assert second.control.control.path.is_relative_to(tmp_path / "data")  # stored with the job's inputs


@pytest.mark.parametrize("extra, files, param, says", [
    ({"canny": {"control_path": "../secret.mp4"}}, [], "extra_params.canny.control_path", "must not contain '..'"),
    ({"canny": {"control_path": "escape.mp4"}}, [], "extra_params.canny.control_path", "outside the control"),
    ({"canny": {"control_path": "missing.mp4"}}, [], "extra_params.canny.control_path", "no such file"),
    ({"canny": {}, "depth": {}}, [], "extra_params.depth", "one control type per request"),
    ({"canny": {"control_context_scale": -1}}, [], "extra_params.canny.control_context_scale", "between 0 and 10"),
    ({"canny": {"control_context_scale": 1e308}}, [], "extra_params.canny.control_context_scale", "between 0 and 10"),
    ({"canny": {"other": 1}}, [], "extra_params.canny.other", ""),
    ({"inpaint": {}}, [], "extra_params.inpaint", "inpaint control needs a mask"),
    ({}, [("mask_reference", ("m.mp4", MP4, "video/mp4"))], "mask_reference", "needs a control type"),
    ({"canny": {"control_path": "edges.mp4"}}, [("control_reference", ("c.mp4", MP4, "video/mp4"))],
     "extra_params.canny.control_path", "not both"),
])
def test_refusals_name_the_field(app, extra, files, param, says):
    client, executor = app()
    with client:
        form = {"prompt": "x", "extra_params": json.dumps(extra)}
        response = client.post("/v1/videos", data=form, files=files or None)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and says in error["message"], error
    assert executor.plans == []


def test_without_a_control_dir_only_uploads(app):
    client, _ = app(with_dir=False)
    with client:
        body = {"prompt": "a", "extra_params": {"canny": {"control_path": "edges.mp4"}}}
        error = client.post("/v1/videos", json=body).json()["error"]
    assert error["param"] == "extra_params.canny.control_path" and "--control-dir" in error["message"]
