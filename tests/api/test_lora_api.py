"""The `lora` request field over HTTP (JSON, multipart, the OpenAI SDK's extra_body), GET /v1/models' adapter
cards, and paths outside the allow-listed root: a 400, never a file read."""

from __future__ import annotations

import json
import time

import pytest
from fake_executor import FakeExecutor
from fastapi.testclient import TestClient

from h3serve.adapters import catalog as catalog_module
from h3serve.adapters.catalog import LoraCatalog
from h3serve.adapters.peft import target_shapes
from h3serve.api.app import create_app
from h3serve.api.server_config import ServerConfig
from h3serve.engine.jobs import JobManager
from h3serve.jobstore.job_files import JobFiles
from h3serve.jobstore.sqlite import SQLiteJobStore
from h3serve.tools.tiny.make_adapter import write_pdd_adapter, write_peft_adapter, write_turbo_adapter

CFG = {"hidden_size": 48, "num_attention_heads": 4, "attention_head_dim": 32, "ffn_dim": 64, "num_layers": 6,
       "num_refiner_layers": 1}


@pytest.fixture(scope="module")
def lora_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("loras")
    write_peft_adapter(root / "style", CFG, rank=4, seed=1)
    write_peft_adapter(root / "other", CFG, rank=2, seed=2)
    write_turbo_adapter(root / "turbo", CFG, rank=8)
    outside = write_peft_adapter(tmp_path_factory.mktemp("outside") / "x", CFG, rank=2, seed=3)
    (root / "escape").symlink_to(outside.parent, target_is_directory=True)
    return root, outside


@pytest.fixture
def app(tmp_path, lora_root):
    def build(with_root: bool = True):
        root, _ = lora_root
        catalog = LoraCatalog(target_shapes(CFG), {"style": str(root / "style"), "turbo": str(root / "turbo")},
                              root=root if with_root else None, log=lambda s: None)
        config = ServerConfig(served_model_name="tiny", data_dir=tmp_path).validate()
        store = SQLiteJobStore(config.store_path)
        executor = FakeExecutor()
        manager = JobManager(executor, store, JobFiles(config.jobs_dir), model_name=config.served_model_name)
        stores.append(store)
        return TestClient(create_app(config, manager, store, lora=catalog)), executor

    stores: list = []
    yield build
    for store in stores:
        store.close()


def _wait_plans(executor, count: int):
    import time

    deadline = time.monotonic() + 10
    while len(executor.plans) < count and time.monotonic() < deadline:
        time.sleep(0.01)
    return executor.plans


def test_models_list_the_adapters_and_requests_carry_them_to_the_engine(app):
    client, executor = app()
    with client:
        cards = client.get("/v1/models").json()["data"]
        assert [c["id"] for c in cards] == ["tiny", "style", "turbo"]
        assert cards[1]["parent"] == "tiny" and cards[1]["lora"]["rank"] == 4 and cards[2]["turbo"]["forwards"] == 4
        sent = [
            {"json": {"prompt": "a", "lora": {"name": "style", "scale": 0.5}}},
            {"data": {"prompt": "b", "lora": json.dumps({"lora_name": "other", "lora_path": "other"})}},
            {"json": {"prompt": "c", "lora": {"adapter": "turbo"}}},  # extra_body lands at the top level too
            {"json": {"prompt": "d"}},
        ]
        for kwargs in sent:
            assert client.post("/v1/videos", **kwargs).status_code == 200
        plans = _wait_plans(executor, 4)
        assert [(p.lora.name, p.lora.scale) if p.lora else None for p in plans] == [
            ("style", 0.5), ("other", 1.0), ("turbo", 1.0), None
        ]
        assert plans[2].steps == 4 and plans[2].flow_shift == 12.0  # the Turbo contract's 4 forwards
        bad = client.post("/v1/videos", json={"prompt": "x", "lora": {"name": "turbo"}, "num_inference_steps": 50})
        assert bad.status_code == 400 and "4-step Turbo adapter" in bad.json()["error"]["message"]
        res = {"prompt": "x", "lora": {"name": "turbo"}, "extra_params": {"sample_solver": "res_multistep"}}
        bad = client.post("/v1/videos", json=res).json()["error"]
        assert bad["param"] == "extra_params.sample_solver" and "4-step Turbo adapter" in bad["message"]
        assert "euler solver only" in bad["message"]


def test_a_pdd_adapter_pins_its_8_forwards_and_refuses_what_its_heads_were_not_made_for(tmp_path):
    """A PDD file through the API: its card says 8 forwards and the tasks it serves; a request naming it runs 8
    forwards at shifts 12 / 3; other steps, shifts or scale are 400s naming the field (the other variant's task:
tests/rank/test_pdd.py)."""
    cfg = {**CFG, "time_embed_dim": 24}
    pdd = write_pdd_adapter(tmp_path / "pdd", cfg, rank=4)
    catalog = LoraCatalog(target_shapes(cfg), {"acc": str(pdd)}, log=lambda s: None, dit_config=cfg)
    config = ServerConfig(served_model_name="tiny", data_dir=tmp_path / "data").validate()
    store = SQLiteJobStore(config.store_path)
    executor = FakeExecutor()
    manager = JobManager(executor, store, JobFiles(config.jobs_dir), model_name=config.served_model_name)
    try:
        with TestClient(create_app(config, manager, store, lora=catalog)) as client:
            card = client.get("/v1/models").json()["data"][1]
            assert card["pdd"] == {"forwards": 8, "tasks": ["t2va", "fl2va"]} and card["turbo"] is None
            assert client.post("/v1/videos", json={"prompt": "a", "lora": {"name": "acc"}}).status_code == 200
            plan = _wait_plans(executor, 1)[0]
            assert (plan.steps, plan.flow_shift, plan.audio_flow_shift, plan.lora.pdd.variant) == (8, 12.0, 3.0,
                                                                                                  "fl2va")
            for extra, param, says in (
                ({"num_inference_steps": 4}, "num_inference_steps", "8-step PDD adapter acc"),
                ({"flow_shift": 5}, "flow_shift", "8-step PDD adapter acc"),
                ({"lora": {"name": "acc", "scale": 0.5}}, "lora.scale", "scale 1 only"),
            ):
                error = client.post("/v1/videos", json={"prompt": "x", "lora": {"name": "acc"}, **extra}).json()
                assert error["error"]["param"] == param and says in error["error"]["message"], error
    finally:
        store.close()


def test_paths_outside_the_root_are_refused_before_any_read(app, lora_root, monkeypatch):
    _, outside = lora_root
    opened: list = []
    read = catalog_module.read_header
    monkeypatch.setattr(catalog_module, "read_header", lambda path: (opened.append(path), read(path))[1])
    for with_root, path, message in (
        (True, "../x/adapter_model.safetensors", "must not contain '..'"),
        (True, "escape/adapter_model.safetensors", "outside the adapter directory"),
        (True, str(outside), "outside the adapter directory"),
        (False, "style", "started without --lora-dir"),
    ):
        client, _ = app(with_root)
        opened.clear()  # the preloaded adapters were read at start-up
        with client:
            r = client.post("/v1/videos", json={"prompt": "x", "lora": {"name": "n", "path": path}})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "lora.path" and message in r.json()["error"]["message"]
        assert opened == []


def test_routes_that_make_a_job_from_a_video_carry_the_adapter(app):
    """remix / edits / extensions resolve `lora` as /v1/videos does: never silently dropped."""
    client, executor = app()
    with client:
        source = client.post("/v1/videos", json={"prompt": "source"}).json()["id"]
        _wait_plans(executor, 1)
        deadline = time.monotonic() + 10
        while client.get(f"/v1/videos/{source}").json()["status"] != "completed" and time.monotonic() < deadline:
            time.sleep(0.05)
        remix = client.post(f"/v1/videos/{source}/remix", json={"prompt": "again", "lora": {"name": "style"}})
        assert remix.status_code == 200, remix.text
        assert _wait_plans(executor, 2)[1].lora.name == "style"
        unknown = client.post(f"/v1/videos/{source}/remix", json={"prompt": "x", "lora": {"name": "nope"}})
        assert unknown.status_code == 400 and unknown.json()["error"]["param"] == "lora.name"
