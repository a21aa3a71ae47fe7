"""Where an H3 checkpoint's components live: one resolver for every layout a model path may hold.

Torch-free: the API process, the planner and `h3serve plan` read a checkpoint's layout, defaults and component
configs without importing torch; the rank processes load the weights (h3serve.loading.components).

Layouts served: a diffusers *modular* root (`modular_model_index.json` and its component folders), a native
MiniMaxAI root with `FL2VA/` and/or `Ref2VA/` (h3serve.checkpoint.native), a single native variant folder, and
FastVideo's FastH3 8-step V2 tree (a modular root with `fastvideo_inference.json`, its VAEs from a base checkpoint:
h3serve.checkpoint.fasth3_v2). A root
carrying both kinds serves the modular layout when its components are all present: it is the diffusers-converted
form, one index names every component, and the release repository carries it next to the original folders; the
choice is logged. A modular index whose component folders are absent falls back to a complete native tree.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

from h3serve.checkpoint import fasth3_v2, native_config
from h3serve.checkpoint.fasth3_v2 import FastH3Contract
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
    contract: FastH3Contract | None = None  # a FastH3 V2 tree's inference contract (kind "fasth3-v2")

    def component(self, name: str) -> Path:
        if name not in self.components:
            if self.contract is not None and name in ("vae", "audio_vae"):
                fasth3_v2.base_vaes(None, self.contract.base_revision)  # raises, naming --base-checkpoint
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
            pinned_schedule=None if self.contract is None else self.contract.pin(),
            distilled_checkpoint=None if self.contract is None else fasth3_v2.NAME,
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


def read_fasth3_v2_layout(
    root: Path, dits: tuple[str, ...], base: Path | None, log: Callable[[str], None] | None = None
) -> CheckpointLayout:
    """A FastH3 8-step V2 tree: its contract checked, its modular components, the VAEs of `base` (without one the
    layout has no VAEs, and asking for them names --base-checkpoint)."""
    contract = fasth3_v2.read_contract(root)
    if "transformer" not in dits:
        raise CheckpointError(f"{root}: the {fasth3_v2.NAME} checkpoint holds a T2VA (FL2VA-partition) DiT only; "
                              "serve it with --task-type fl2va (or auto), not ref2va")
    if not (root / INDEX_FILE).is_file():
        raise CheckpointError(f"{root}: a {fasth3_v2.NAME} tree is a modular checkpoint; {INDEX_FILE} is missing")
    modular = read_modular_layout(root)
    components = {k: v for k, v in modular.components.items() if k not in ("vae", "audio_vae", "transformer_ref")}
    layout = CheckpointLayout(root, components, modular.pipeline_config, kind="fasth3-v2", contract=contract)
    gaps = _modular_gaps(layout, ("transformer",))
    if "transformer" not in components:
        gaps.append("transformer: not in the index")
    if gaps:
        raise CheckpointError(f"{root}: incomplete {fasth3_v2.NAME} checkpoint: " + "; ".join(gaps))
    if base is None:
        return layout
    vaes = fasth3_v2.base_vaes(base, contract.base_revision)
    _say(log, f"{root}: {fasth3_v2.describe(contract)}; VAEs from {base} ({vaes.note})")
    return dataclasses.replace(layout, components={**components, **vaes.components},
                               formats=MappingProxyType(vaes.formats))


def read_layout(
    root: str | Path,
    dits: tuple[str, ...] = ALL_DITS,
    log: Callable[[str], None] | None = None,
    base: str | Path | None = None,
) -> CheckpointLayout:
    """Resolve a model path to its components, for the DiTs `dits` (what `--task-type` selects). `base`: the
    MiniMax-H3 checkpoint whose VAEs a FastH3 V2 tree decodes with (--base-checkpoint).

    Refused with every gap named: a half-downloaded tree, a variant missing for the requested DiTs, a path that is
    no H3 checkpoint at all.
    """
    root = Path(root).expanduser().resolve()
    if not root.is_dir():
        raise CheckpointError(f"model directory not found: {root}")
    if fasth3_v2.is_fasth3_v2(root):
        return read_fasth3_v2_layout(root, dits, None if base is None else Path(base), log)
    if base is not None:
        raise CheckpointError(f"--base-checkpoint {base}: only a FastH3 V2 checkpoint takes its VAEs from a base; "
                              f"{root} has its own")
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
