"""Where an H3 checkpoint's components live: one resolver for every layout a model path may hold.

Torch-free: the API process, the planner and `h3serve plan` read a checkpoint's layout, defaults and component
configs without importing torch; the rank processes load the weights (h3serve.loading.components).

Layouts served: a diffusers *modular* root (`modular_model_index.json` and its component folders), a native
MiniMaxAI root with `FL2VA/` and/or `Ref2VA/` (h3serve.checkpoint.native), and a single native variant folder. A root
carrying both kinds serves the modular layout when its components are all present: it is the diffusers-converted
form, one index names every component, and the release repository carries it next to the original folders; the
choice is logged. A modular index whose component folders are absent falls back to a complete native tree.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

from h3serve.checkpoint import native_config
from h3serve.checkpoint.file_reading import INDEX_FILE, CheckpointError, missing_weights, read_json, safetensors_files
from h3serve.checkpoint.native import read_native, variant_folders
from h3serve.rules.defaults import ModelDefaults

__all__ = ["INDEX_FILE", "CheckpointError", "CheckpointLayout", "read_json", "read_layout", "safetensors_files"]

ALL_DITS = ("transformer", "transformer_ref")
_log = logging.getLogger("h3serve.checkpoint")
_said: set[str] = set()


@dataclass(frozen=True)
class CheckpointLayout:
    """Where each component of one checkpoint lives, plus the pipeline config values from the index.

    `formats` marks the components stored in the native MiniMaxAI form ("native"; absent: diffusers'), `shifts` the
    scheduler shifts a native tree declares in its `sigma_shift_scales` (it has no scheduler folders).
    """

    root: Path
    components: dict[str, Path]
    pipeline_config: dict
    kind: str = "modular"
    formats: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    shifts: Mapping[str, float] = field(default_factory=lambda: MappingProxyType({}))

    def component(self, name: str) -> Path:
        if name not in self.components:
            raise CheckpointError(f"{self.root}: the checkpoint has no '{name}' component")
        return self.components[name]

    def has(self, name: str) -> bool:
        return name in self.components

    def is_native(self, name: str) -> bool:
        return self.formats.get(name) == "native"

    def component_config(self, name: str) -> dict:
        """A component's config in h3serve's (= diffusers') argument names, whichever form it is stored in."""
        folder = self.component(name)
        if name in ALL_DITS:
            return native_config.dit_config(read_json(folder / "config.json"), str(folder / "config.json"))[0]
        if name == "vae" and self.is_native(name):
            return native_config.video_vae_config(folder)
        if name == "audio_vae" and self.is_native(name):
            return native_config.audio_vae_config(folder)
        return read_json(folder / "config.json")

    def defaults(self) -> ModelDefaults:
        """Request defaults from the checkpoint (canvas sizes from the index, shifts from the schedulers)."""
        base = ModelDefaults()
        cfg = self.pipeline_config

        def shift(name: str, fallback: float) -> float:
            if name in self.shifts:
                return float(self.shifts[name])
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


def read_modular_layout(root: Path) -> CheckpointLayout:
    """Parse `modular_model_index.json`: entries are `[library, class, {pretrained_model_name_or_path, subfolder}]`.

    A component whose path is empty or relative lives under `root`, so a moved folder still loads.
    """
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


def _modular_gaps(layout: CheckpointLayout, dits: tuple[str, ...]) -> list[str]:
    """The wanted components of a modular layout that are absent or half-downloaded."""
    gaps = []
    for name, folder in layout.components.items():
        if name in ALL_DITS and name not in dits:
            continue
        if not folder.is_dir():
            gaps.append(f"{name}: folder {folder} missing")
        elif any(folder.glob("*.safetensors.index.json")) and (problem := missing_weights(folder, name)):
            gaps.append(problem)
    return gaps


def _say(log: Callable[[str], None] | None, text: str) -> None:
    if log is not None:
        log(text)
    elif text not in _said:
        _said.add(text)
        _log.warning(text)


def read_layout(
    root: str | Path, dits: tuple[str, ...] = ALL_DITS, log: Callable[[str], None] | None = None
) -> CheckpointLayout:
    """Resolve a model path to its components, for the DiTs `dits` (what `--task-type` selects).

    Refused with every gap named: a half-downloaded tree, a variant missing for the requested DiTs, a path that is
    no H3 checkpoint at all.
    """
    root = Path(root).expanduser().resolve()
    if not root.is_dir():
        raise CheckpointError(f"model directory not found: {root}")
    modular = (root / INDEX_FILE).is_file()
    native = bool(variant_folders(root))
    if not modular and not native:
        raise CheckpointError(
            f"{root}: not an H3 checkpoint: no {INDEX_FILE} (diffusers modular layout), no FL2VA/ or Ref2VA/ folder "
            "and no model_index.json with a _minimax_h3 block (native layout)"
        )
    if modular:
        layout = read_modular_layout(root)
        gaps = _modular_gaps(layout, dits)
        if not gaps:
            if native:
                _say(
                    log,
                    f"{root}: holds both the diffusers modular layout and native FL2VA/Ref2VA folders; "
                    f"serving the modular one ({INDEX_FILE} names every component; the native folders are not read)",
                )
            return layout
        if not native:
            raise CheckpointError(f"{root}: incomplete checkpoint: " + "; ".join(gaps))
        _say(log, f"{root}: the modular layout is incomplete ({'; '.join(gaps)}); serving the native FL2VA/Ref2VA tree")
    tree = read_native(root, dits)
    return CheckpointLayout(
        root=root,
        components=tree.components,
        pipeline_config=tree.pipeline_config,
        kind="native",
        formats=MappingProxyType(tree.formats),
        shifts=MappingProxyType(tree.shifts),
    )
