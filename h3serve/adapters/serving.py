"""What a server's LoRA flags mean: its adapter catalog, and the configurations that cannot serve LoRA."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path

from h3serve.adapters.catalog import LoraCatalog, lora_file
from h3serve.adapters.header import AdapterError
from h3serve.adapters.peft import target_shapes
from h3serve.adapters.taomate import read_config
from h3serve.adapters.weight_edits import WeightEdits, lora_edits
from h3serve.config.engine_config import EngineConfig
from h3serve.rules.adapter_choice import AdapterChoice
from h3serve.rules.defaults import ModelDefaults

DITS = ("transformer", "transformer_ref")


def dit_config(model: Path, dits: tuple[str, ...] = DITS) -> dict:
    """The first present DiT's config.json (FL2VA and Ref2VA DiTs share one architecture)."""
    for name in dits:
        path = model / name / "config.json"
        if path.is_file():
            return json.loads(path.read_text())
    raise AdapterError(f"{model}: none of the DiTs {', '.join(dits)} has a config.json")


def engine_defaults(config: EngineConfig, defaults: ModelDefaults) -> ModelDefaults:
    """The checkpoint's request defaults on this engine: with a ControlNet branch, control requests are served;
    under a fused FastH3 adapter, its pinned schedule, T2VA only; a merged LoRA adapter (--merge-lora) runs in every
    request (`h3serve.rules.adapter_choice.merged_choice`)."""
    defaults = dataclasses.replace(defaults, controlnet=config.controlnet_model_path is not None)
    merged = merged_adapter(config)
    if merged is not None:
        return dataclasses.replace(defaults, merged_lora=merged)
    if config.dit_adapter is None:
        return defaults
    from h3serve.adapters.fasth3 import POSITIONS, adapter_path
    from h3serve.rules.schedule import PinnedSchedule

    name = adapter_path(config.dit_adapter).name
    pin = PinnedSchedule(owner=f"the fused FastH3 adapter {name}", positions=POSITIONS)
    return dataclasses.replace(defaults, pinned_schedule=pin, fused_adapter=name)


def lora_enabled(config: EngineConfig) -> bool:
    return bool(config.lora_paths) or config.lora_dir is not None


def catalog_for(config: EngineConfig, log: Callable[[str], None] | None = None) -> LoraCatalog | None:
    """The engine's adapter catalog (None without --lora-path/--lora-dir); `AdapterError` on a bad adapter."""
    if not lora_enabled(config):
        return None
    dit = dit_config(config.model, config.dits)
    root = None if config.lora_dir is None else Path(config.lora_dir)
    kwargs = {} if log is None else {"log": log}
    return LoraCatalog(target_shapes(dit), dict(config.lora_paths), config.lora_scale, root, config.max_lora_rank,
                       dit_config=dit, **kwargs)


def slot_rank(config: EngineConfig, catalog: LoraCatalog | None) -> int:
    """The LoRA wrappers' slot rank: the catalog's, or the real-time LoRA's when larger (0: no LoRA wrappers). A
    merged adapter needs none: it is in the weights."""
    realtime = 0 if config.realtime_lora is None else read_config(Path(config.realtime_lora))[0]
    served = 0 if catalog is None or config.merge_lora else catalog.slot_rank
    return max(served, realtime)


def merged_adapter(config: EngineConfig) -> AdapterChoice | None:
    """The adapter `--merge-lora` fuses into the weights (the one --lora-path, at --lora-scale); None without it."""
    if not config.merge_lora:
        return None
    catalog = catalog_for(config, log=lambda text: None)
    if catalog is None or len(catalog.preloaded) != 1:
        raise AdapterError("--merge-lora fuses exactly one --lora-path adapter")
    return next(iter(catalog.preloaded.values()))


def merged_edits(config: EngineConfig) -> WeightEdits | None:
    """The merged adapter as edits of the DiT's weights (h3serve.loading.fasth3_fusion fuses them at load)."""
    choice = merged_adapter(config)
    if choice is None:
        return None
    info = lora_file(choice.path, target_shapes(dit_config(config.model, config.dits)))
    return lora_edits(info, choice.scale)
