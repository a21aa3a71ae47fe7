"""The tiny checkpoint's components with the streaming LoRA installed (unmerged, switchable), for the session tests."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch


@pytest.fixture(scope="session")
def realtime_parts(tiny_checkpoint, tmp_path_factory):
    from h3serve.checkpoint.resolver import read_layout
    from h3serve.loading.components import load_components
    from h3serve.rank.lora import LoraRuntime
    from h3serve.rules.adapter_choice import AdapterChoice
    from h3serve.tools.tiny.make_adapter import write_taomate_adapter

    components = load_components(read_layout(tiny_checkpoint))
    dit = components.transformer
    dit.fuse_projections()
    folder = write_taomate_adapter(tmp_path_factory.mktemp("taomate") / "lora", dataclasses.asdict(dit.config))
    runtime = LoraRuntime({"transformer": dit}, slot_rank=4)
    choice = AdapterChoice("realtime", str(folder), 1.0, 0, 4, 4.0)

    class Switch:
        def student(self) -> None:
            runtime.activate("transformer", choice)

        def base(self) -> None:
            runtime.activate("transformer", None)

    return SimpleNamespace(components=components, dit=dit, lora=Switch(), device=torch.device("cpu"))
