"""Reading a checkpoint's files without torch: JSON configs, safetensors indexes and headers, shard completeness.

The leaf under `checkpoint_layout` (the layout resolver) and `native_layout` (the MiniMaxAI FL2VA/Ref2VA trees).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

from h3serve.errors import ServerError

INDEX_FILE = "modular_model_index.json"
_HEADER_LIMIT = 100 * 1024 * 1024  # safetensors' own cap on a header


class CheckpointError(ServerError, RuntimeError):
    """The checkpoint folder is missing something or is inconsistent; the message names what."""

    code = "invalid_checkpoint"


def read_json(path: Path) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"missing file: {path}") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: invalid JSON ({e})") from None


def _index_files(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.safetensors.index.json"))


def declared_weight_files(folder: Path) -> list[Path]:
    """The weight files a component folder declares: those named by its index json, else every *.safetensors."""
    indexes = _index_files(folder)
    if indexes:
        weight_map = read_json(indexes[0]).get("weight_map", {})
        return [folder / f for f in sorted(set(weight_map.values()))]
    return sorted(folder.glob("*.safetensors"))


def missing_weights(folder: Path, label: str) -> str | None:
    """Why `folder`'s weights are incomplete ("Ref2VA/transformer: 3 of 14 shards present (missing: ...)"), or None."""
    declared = declared_weight_files(folder)
    if not declared:
        return f"{label}: no *.safetensors weights found"
    absent = [f.name for f in declared if not f.is_file()]
    if not absent:
        return None
    shown = ", ".join(absent[:3]) + (" ..." if len(absent) > 3 else "")
    present = len(declared) - len(absent)
    return f"{label}: {present} of {len(declared)} shards present (missing: {shown})"


def safetensors_files(folder: Path) -> list[Path]:
    """The weight files of a component folder, all present: a half-downloaded folder is refused by name."""
    problem = missing_weights(folder, str(folder))
    if problem is not None:
        raise CheckpointError(problem)
    return declared_weight_files(folder)


def safetensors_header(path: Path) -> dict:
    """The JSON header of one safetensors file (tensor name -> dtype/shape/offsets, plus `__metadata__`)."""
    try:
        with open(path, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            if size > _HEADER_LIMIT:
                raise CheckpointError(f"{path}: safetensors header of {size} bytes is over the format's limit")
            return json.loads(f.read(size))
    except FileNotFoundError:
        raise CheckpointError(f"missing file: {path}") from None
    except (struct.error, ValueError) as e:
        raise CheckpointError(f"{path}: not a safetensors file ({e})") from None


def weight_keys(files: list[Path]) -> list[str]:
    """Every tensor name over all of a component's weight files (an index's weight map when there is one)."""
    keys: list[str] = []
    for file in files:
        keys.extend(k for k in safetensors_header(file) if k != "__metadata__")
    return keys


def file_metadata(path: Path) -> dict[str, str]:
    """The `__metadata__` string map of a safetensors file (empty when it has none)."""
    return dict(safetensors_header(path).get("__metadata__") or {})
