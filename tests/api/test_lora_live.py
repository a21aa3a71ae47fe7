"""Two LoRA adapters (made by `h3serve make-tiny-adapter --format peft`) and none, interleaved on one live
`h3serve serve` whose DiT blocks are compiled: each MP4 is byte-identical to the same request through an
in-process engine of the same flags, and /metrics shows that switching adapters reloaded nothing (one model
load, each adapter file read once and placed on the device once) and compiled no new graph."""

from __future__ import annotations

import argparse
import shlex

import httpx
import pytest
from api_servers import start_live_server
from prometheus_client.parser import text_string_to_metric_families

from h3serve.adapters.catalog import LoraField
from h3serve.adapters.serving import catalog_for
from h3serve.entrypoints.cli import main
from h3serve.entrypoints.engine_args import add_engine_args, engine_config_from_args
from h3serve.media.mp4 import EncoderOptions
from h3serve.media.sink import Mp4Sink
from h3serve.rank.model_runner import ModelRunner
from h3serve.rules.request import GenerationRequest

pytestmark = pytest.mark.slow

# Compiled regional blocks, captured by Dynamo only (the eager backend: inductor's C++ build takes minutes here).
COMPILED = "--threads 1 --task-type fl2va --diffusion-compile-granularity regional --diffusion-compile-backend eager"
PROMPT, SEED = "a fox in the snow", 5
SEQUENCE = (("a", 1.0), (None, None), ("b", 2.0), ("a", 1.0))


def _counters(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    wanted = ("h3serve_engine_loads_total", "h3serve_lora_adapter_loads_total", "h3serve_compiled_graphs_total")
    return {
        f"{s.name}{s.labels.get('memory', '')}": s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name in wanted and s.labels.get("replica") == "0"
    }


def _references(checkpoint, flags: str, tmp_path) -> list[bytes]:
    """The MP4 of each request of SEQUENCE through an in-process engine built from the server's engine flags."""
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    config = engine_config_from_args(parser.parse_args(shlex.split(flags)), checkpoint)
    engine, catalog = ModelRunner(config), catalog_for(config)
    out = []
    for i, (name, scale) in enumerate(SEQUENCE):
        lora = None if name is None else catalog.choose(LoraField(name=name, scale=scale))
        plan = engine.plan(GenerationRequest(prompt=PROMPT, duration_s=4, steps=1, seed=SEED, lora=lora))
        path = tmp_path / f"reference-{i}.mp4"
        engine.generate(plan, sink=Mp4Sink(path, EncoderOptions(preset="ultrafast")))
        out.append(path.read_bytes())
    return out


def test_two_adapters_and_none_interleave_without_reload_or_recompile(tiny_checkpoint, tmp_path):
    for name, seed in (("a", 1), ("b", 2)):
        assert main(["make-tiny-adapter", str(tmp_path / name), "--format", "peft", "--seed", str(seed)]) == 0
    flags = f"{COMPILED} --lora-path a={tmp_path / 'a'} --lora-path b={tmp_path / 'b'}"
    server = start_live_server(tiny_checkpoint, tmp_path / "data", *shlex.split(flags))
    try:
        served, seen = [], []
        for name, scale in SEQUENCE:
            body = {"prompt": PROMPT, "seconds": "4", "num_inference_steps": 1, "seed": SEED}
            if name is not None:
                body["lora"] = {"name": name, "scale": scale}
            response = httpx.post(f"{server.url}/v1/videos/sync", json=body, timeout=300)
            assert response.status_code == 200, response.text
            served.append(response.content)
            seen.append(_counters(server.url))
    finally:
        server.stop()
    references = _references(tiny_checkpoint, flags, tmp_path)
    for i, (mp4, reference) in enumerate(zip(served, references, strict=True)):
        assert mp4 == reference, f"request {i} ({SEQUENCE[i][0]}) differs from its in-process reference"
    assert len({served[0], served[1], served[2]}) == 3 and served[3] == served[0]  # each adapter shows
    graphs = seen[0]["h3serve_compiled_graphs_total"]
    assert graphs > 0  # the blocks were compiled at the first request
    assert seen[-1] == {
        "h3serve_engine_loads_total": 1,  # never reloaded
        "h3serve_lora_adapter_loads_totalhost": 2,  # each file read once
        "h3serve_lora_adapter_loads_totaldevice": 2,  # and placed on the device once (--max-loras 2)
        "h3serve_compiled_graphs_total": graphs,  # no recompile when the adapter, or none, changes
    }
    assert [s["h3serve_lora_adapter_loads_totalhost"] for s in seen] == [1, 1, 2, 2]
