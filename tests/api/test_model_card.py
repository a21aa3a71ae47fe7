"""GET /v1/models: the served model's card lists its capabilities (the DiT caches and their request controls,
video sparse attention, a distilled checkpoint's pinned schedule) and a FlashGen adapter's card its contract; and a
TeaCache server plans a request's forced refresh while a server without a cache refuses it (400)."""

from __future__ import annotations

import dataclasses
import json

import pytest
from fake_executor import FakeExecutor
from fastapi.testclient import TestClient

from h3serve.adapters.catalog import LoraCatalog
from h3serve.adapters.peft import target_shapes
from h3serve.api.app import create_app
from h3serve.api.server_config import ServerConfig
from h3serve.checkpoint.resolver import read_layout
from h3serve.config.engine_config import EngineConfig
from h3serve.engine.jobs import JobManager
from h3serve.jobstore.job_files import JobFiles
from h3serve.jobstore.sqlite import SQLiteJobStore
from h3serve.tools.tiny.make_adapter import write_flashgen_adapter
from h3serve.tools.tiny.make_fasth3_v2 import v2_from_modular


@pytest.fixture
def serve(tmp_path):
    stores = []

    def build(engine: EngineConfig, defaults=None, lora=None) -> TestClient:
        config = ServerConfig(served_model_name="tiny", data_dir=tmp_path / f"d{len(stores)}").validate()
        store = SQLiteJobStore(config.store_path)
        stores.append(store)
        executor = FakeExecutor(tasks=("t2va", "fl2va"))
        if defaults is not None:
            executor.defaults = defaults
        manager = JobManager(executor, store, JobFiles(config.jobs_dir), model_name=config.served_model_name)
        return TestClient(create_app(config, manager, store, lora=lora, engine=engine))

    yield build
    for store in stores:
        store.close()


def _card(client: TestClient) -> list[dict]:
    response = client.get("/v1/models")
    assert response.status_code == 200, response.text
    return response.json()["data"]


def test_a_teacache_server_lists_its_cache_and_a_flashgen_adapter(serve, tiny_checkpoint, tmp_path):
    cfg = json.loads((tiny_checkpoint / "transformer" / "config.json").read_text())
    flash = write_flashgen_adapter(tmp_path / "flash", cfg)
    lora = LoraCatalog(target_shapes(cfg), {"flash": str(flash)}, log=lambda s: None, dit_config=cfg)
    engine = EngineConfig(model=tiny_checkpoint, cache_backend="tea_cache", cache_config='{"rel_l1_thresh": 0.2}')
    defaults = dataclasses.replace(read_layout(tiny_checkpoint).defaults(), server_cache="tea_cache")
    with serve(engine, defaults, lora) as client:
        model, adapter = _card(client)
        cache = model["capabilities"]["cache"]
        assert cache["server"]["backend"] == "tea_cache" and cache["server"]["rel_l1_thresh"] == 0.2
        assert cache["server"]["tasks"] == ["t2va", "fl2va"] and cache["quality"]["high"]["backend"] == "cache_dit"
        assert cache["force_refresh"]["policies"] == ["once", "repeat"]
        assert model["capabilities"]["attention"] == {"backend": "auto"}
        guides = model["capabilities"]["timeline_guides"]
        assert guides["served"] is True and guides["limits"]["max_entries"] == 8
        assert "tea_cache" in guides["quality"]  # an omitted quality runs the server's cache: guides need lossless
        assert adapter["id"] == "flash" and adapter["flashgen"]["forwards"] == 4
        assert adapter["flashgen"]["base_schedule"] == [1.0, 0.7, 0.4, 0.15, 0.0]
        body = {"prompt": "waves", "seconds": "4", "extra_params": {"force_refresh_step_hint": 3}}
        assert client.post("/v1/videos", json=body).status_code == 200  # planned under the server's TeaCache
        refused = client.post("/v1/videos", json={**body, "quality": "lossless"})
        assert refused.status_code == 400 and "needs a DiT cache" in refused.text


def test_a_fasth3_v2_server_lists_vsa_and_its_pinned_schedule(serve, tiny_checkpoint, tmp_path):
    v2 = v2_from_modular(tiny_checkpoint, tmp_path / "v2")
    engine = EngineConfig(model=v2, base_checkpoint=tiny_checkpoint, attention_backend="FASTVIDEO_VSA")
    with serve(engine, read_layout(v2, base=tiny_checkpoint).defaults()) as client:
        (model,) = _card(client)
        capabilities = model["capabilities"]
        assert capabilities["attention"]["video_sparse_attention"] == {"tile_rows": 64, "video_tile": [4, 4, 4],
                                                                       "sparsity": 0.8}
        assert capabilities["pinned_schedule"]["forwards"] == 8 and capabilities["pinned_schedule"]["flow_shift"] == 10
        assert capabilities["checkpoint"] == {"name": "FastH3 8-step V2", "lora": False}
        guides = capabilities["timeline_guides"]  # every request runs the pinned schedule: guides are refused
        assert guides["served"] is False and "pins a distilled schedule" in guides["reason"]
        refused = client.post("/v1/videos", json={"prompt": "waves", "seconds": "4", "num_inference_steps": 4})
        assert refused.status_code == 400 and "runs exactly 8 steps" in refused.text
