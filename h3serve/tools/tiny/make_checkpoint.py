"""Deterministic, random-weight MiniMax-H3 checkpoints in the diffusers *modular* layout.

The checkpoint has every component the diffusers ``MiniMaxH3ModularPipeline`` expects, with tiny configs (docs/model.md
§1 has the released ones), so that every workflow runs in seconds on a CPU. Same preset and seed give byte-identical
files.

The ``modular_model_index.json`` stores ``pretrained_model_name_or_path: null`` with ``subfolder = <component>``:
diffusers resolves a component to the directory passed to ``ModularPipeline.from_pretrained`` whenever that
directory holds the component's files, so the checkpoint loads from wherever it is moved to.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from h3serve.tools.tiny.build_files import file_lock, make_readable, quiet_progress_bars, replace_dir, write_json
from h3serve.tools.tiny.make_components import build_components, write_index
from h3serve.tools.tiny.make_text import make_processor
from h3serve.tools.tiny.presets import PRESETS, Preset, check_seed, get_preset

if TYPE_CHECKING:
    from transformers import Qwen3VLProcessor

__all__ = [
    "MARKER_FILE",
    "PRESETS",
    "Preset",
    "build_tiny_checkpoint",
    "cache_root",
    "default_checkpoint_dir",
    "ensure_tiny_checkpoint",
    "is_complete_checkpoint",
    "load_processor",
    "marker_of",
]

# Bump when the generated files change, so that cached checkpoints are rebuilt.
FORMAT_VERSION = 2
# Written last into a checkpoint: marks it complete and records what it was built from.
MARKER_FILE = "tiny_checkpoint.json"


def build_tiny_checkpoint(out_dir: str | Path, seed: int = 0, preset: str = "tiny") -> Path:
    """Write a complete random-weight checkpoint into ``out_dir`` (absent or empty) and return its path."""
    spec = get_preset(preset)
    seed = check_seed(seed)
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"refusing to build a checkpoint into non-empty directory {out}")
    out.mkdir(parents=True, exist_ok=True)

    components = build_components(spec, seed)
    with quiet_progress_bars():
        for name in sorted(components):
            components[name].save_pretrained(str(out / name))
    write_index(out, components, spec)
    make_readable(out)
    write_json(out / MARKER_FILE, marker_of(preset, seed))
    return out


def cache_root() -> Path:
    """The h3serve cache: ``$H3SERVE_CACHE_DIR``, else ``$XDG_CACHE_HOME/h3serve``, else ``~/.cache/h3serve``."""
    if explicit := os.environ.get("H3SERVE_CACHE_DIR"):
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "h3serve"


def default_checkpoint_dir(preset: str = "tiny", seed: int = 0) -> Path:
    """Where :func:`ensure_tiny_checkpoint` keeps the checkpoint of ``preset`` and ``seed``."""
    get_preset(preset)
    return cache_root() / "checkpoints" / f"{preset}-seed{check_seed(seed)}"


def is_complete_checkpoint(path: str | Path, preset: str = "tiny", seed: int = 0) -> bool:
    """Whether ``path`` holds a finished checkpoint of this preset, seed and format version."""
    try:
        marker = json.loads((Path(path) / MARKER_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return marker == marker_of(preset, seed)


def ensure_tiny_checkpoint(preset: str = "tiny", seed: int = 0) -> Path:
    """Return the cached checkpoint of ``preset``/``seed``, building it first if needed.

    The build goes into a temporary directory beside the target and is renamed into place, under an exclusive
    ``fcntl`` lock, so concurrent callers build it once and never see a partial checkpoint.
    """
    target = default_checkpoint_dir(preset, seed)
    if is_complete_checkpoint(target, preset, seed):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(target.parent / f".{target.name}.lock"):
        if is_complete_checkpoint(target, preset, seed):
            return target
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
        try:
            build_tiny_checkpoint(staging, seed=seed, preset=preset)
            replace_dir(staging, target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return target


def load_processor(checkpoint_dir: str | Path) -> Qwen3VLProcessor:
    """Load ``<checkpoint_dir>/processor`` without torchvision.

    ``Qwen3VLProcessor.from_pretrained`` needs torchvision to resolve its video processor class. The parts are loaded
    one by one instead (PIL image processor, tokenizer, video processor config) and assembled in memory.
    """
    from transformers import Qwen2TokenizerFast, Qwen2VLImageProcessorPil
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    folder = str(Path(checkpoint_dir) / "processor")
    image_processor = Qwen2VLImageProcessorPil.from_pretrained(folder)
    video_processor = Qwen3VLVideoProcessor.from_pretrained(folder)
    tokenizer = Qwen2TokenizerFast.from_pretrained(folder)
    return make_processor(image_processor, tokenizer, video_processor)


def marker_of(preset: str, seed: int) -> dict[str, Any]:
    """What the marker file of a complete checkpoint of `preset` and `seed` holds."""
    return {"format_version": FORMAT_VERSION, "preset": preset, "seed": seed}
