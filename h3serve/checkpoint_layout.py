"""Where an H3 checkpoint's components live: the index file, component folders, configs and weight files.

Torch-free: the API process, the planner and `h3serve plan` read a checkpoint's layout and defaults without
importing torch; the rank processes load the weights (h3serve.rank.checkpoint).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from h3serve.errors import ServerError
from h3serve.validate import ModelDefaults

INDEX_FILE = "modular_model_index.json"


class CheckpointError(ServerError, RuntimeError):
    """The checkpoint folder is missing something or is inconsistent; the message names what."""

    code = "invalid_checkpoint"


@dataclass(frozen=True)
class CheckpointLayout:
    """Where each component of one checkpoint lives, plus the pipeline config values from the index."""

    root: Path
    components: dict[str, Path]
    pipeline_config: dict

    def component(self, name: str) -> Path:
        if name not in self.components:
            raise CheckpointError(f"{self.root}: the checkpoint has no '{name}' component")
        return self.components[name]

    def has(self, name: str) -> bool:
        return name in self.components

    def defaults(self) -> ModelDefaults:
        """Request defaults from the checkpoint (canvas sizes from the index, shifts from the schedulers)."""
        base = ModelDefaults()
        cfg = self.pipeline_config

        def shift(name: str, fallback: float) -> float:
            path = self.components.get(name)
            if path is None or not (path / "scheduler_config.json").exists():
                return fallback
            return float(read_json(path / "scheduler_config.json").get("shift", fallback))

        return ModelDefaults(
            canvas_short_edge=int(cfg.get("canvas_short_edge", base.canvas_short_edge)),
            canvas_max_pixels=int(cfg.get("canvas_max_pixels", base.canvas_max_pixels)),
            reference_image_short_edge=int(cfg.get("reference_image_short_edge", base.reference_image_short_edge)),
            flow_shift=shift("scheduler", base.flow_shift),
            audio_flow_shift=shift("audio_scheduler", base.audio_flow_shift),
        )


def read_json(path: Path) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"missing file: {path}") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: invalid JSON ({e})") from None


def read_layout(root: str | Path) -> CheckpointLayout:
    """Parse `modular_model_index.json`: entries are `[library, class, {pretrained_model_name_or_path, subfolder}]`.

    A component whose path is empty or relative lives under `root`, so a moved folder still loads.
    """
    root = Path(root).expanduser().resolve()
    if not root.is_dir():
        raise CheckpointError(f"model directory not found: {root}")
    index = read_json(root / INDEX_FILE)
    components: dict[str, Path] = {}
    config: dict = {}
    for name, value in index.items():
        if name.startswith("_"):
            continue
        if isinstance(value, list) and len(value) == 3 and isinstance(value[2], dict):
            spec = value[2]
            base = spec.get("pretrained_model_name_or_path")
            base_path = root if not base else Path(base) if Path(base).is_absolute() else root / base
            sub = spec.get("subfolder") or ""
            path = base_path / sub if sub else base_path
            if not path.is_dir():
                path = root / name  # a moved or re-rooted checkpoint: fall back to the conventional folder
            components[name] = path
        else:
            config[name] = value
    return CheckpointLayout(root=root, components=components, pipeline_config=config)


def safetensors_files(folder: Path) -> list[Path]:
    """The weight files of a component folder: those named by an index json, else every *.safetensors."""
    indexes = sorted(folder.glob("*.safetensors.index.json"))
    if indexes:
        weight_map = read_json(indexes[0]).get("weight_map", {})
        return [folder / f for f in sorted(set(weight_map.values()))]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{folder}: no *.safetensors weights found")
    return files
