"""What `train-demo` keeps between its stages on disk: laid-out examples and module weights, exactly (float32 bits),
in safetensors files with a JSON side file; nothing is pickled, so a training folder is safe to resume from."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from h3serve.demo.training.examples import Example
from h3serve.model.layout import Layout
from h3serve.model.transformer import PackedLayout

_TENSORS = ("text_states", "conditions", "audio_references", "video", "audio")
_PACKED = ("token_tags", "position_ids", "video_indices", "audio_indices", "text_indices")


def replace_file(path: Path, write) -> None:
    """Write `path` through `write(temporary path)` and move it into place, so a stop mid-write leaves the old file."""
    temporary = path.with_name(f".{path.name}.partial")
    write(temporary)
    os.replace(temporary, path)


def write_text(path: Path, text: str) -> None:
    replace_file(path, lambda p: p.write_text(text, encoding="utf-8"))


def save_examples(path: Path, examples: Sequence[Example]) -> None:
    """`examples` into `path` (safetensors) and `path`.json. A tensor several examples share (a clip's targets) is
    stored once."""
    tensors: dict[str, torch.Tensor] = {}
    keys: dict[int, str] = {}
    records = []

    def key(tensor: torch.Tensor) -> str:
        if id(tensor) not in keys:
            keys[id(tensor)] = name = f"t{len(keys)}"
            tensors[name] = tensor.detach().cpu().contiguous().clone()
        return keys[id(tensor)]

    for example in examples:
        layout = example.layout
        records.append({
            "kind": example.kind,
            "prompt": example.prompt,
            "anchored_rows": example.anchored_rows,
            "click_rows": list(example.click_rows),
            "num_video_condition_rows": layout.num_video_condition_rows,
            "num_audio_reference_rows": layout.num_audio_reference_rows,
            "tensors": {name: key(getattr(example, name)) for name in _TENSORS},
            "packed": {name: key(getattr(layout.packed, name)) for name in _PACKED},
            "roles": key(layout.roles),
        })
    replace_file(path, lambda p: save_file(tensors, str(p)))
    write_text(path.with_name(path.name + ".json"), json.dumps(records))


def load_examples(path: Path) -> list[Example]:
    """The examples `save_examples` wrote, in order, their tensors equal bit for bit."""
    tensors = load_file(str(path))
    records = json.loads(path.with_name(path.name + ".json").read_text(encoding="utf-8"))
    examples = []
    for record in records:
        packed = PackedLayout(**{name: tensors[k] for name, k in record["packed"].items()})
        layout = Layout(packed, tensors[record["roles"]], record["num_video_condition_rows"],
                        record["num_audio_reference_rows"])
        fields = {name: tensors[k] for name, k in record["tensors"].items()}
        examples.append(Example(record["kind"], record["prompt"], layout=layout, anchored_rows=record["anchored_rows"],
                                click_rows=tuple(record["click_rows"]), **fields))
    return examples


def save_module(module: nn.Module, path: Path) -> None:
    """A module's state (parameters and buffers) at full precision, contiguous (channels-last weights included)."""
    state = {k: v.detach().cpu().contiguous().clone() for k, v in module.state_dict().items()}
    replace_file(path, lambda p: save_file(state, str(p)))


def load_module(module: nn.Module, path: Path) -> None:
    """`save_module`'s values copied into `module` (which keeps its own devices and memory formats)."""
    module.load_state_dict(load_file(str(path)))


def save_state(path: Path, state: dict) -> None:
    """A trainer's state (tensors, numbers, strings, lists and dicts) with `torch.save`."""
    replace_file(path, lambda p: torch.save(state, p))


def load_state(path: Path) -> dict:
    """`save_state`'s dict, read weights-only (no code runs from the file), its tensors on the CPU."""
    return torch.load(path, map_location="cpu", weights_only=True)
