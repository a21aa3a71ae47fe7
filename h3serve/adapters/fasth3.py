"""FastVideo's FastH3 adapter (a 4-step DMD2 student), recognised by its metadata and fused at load (torch-free).

Not a request-switchable LoRA: `W = W_base + B@A` (scale exactly 1, no alpha), `.diff` tensors add to weights and
`.diff_b` to biases, computed in fp32 before any sharding (h3serve.loading.fasth3_fusion). Claimed only when the
metadata says format `fastvideo-lora-v2`, names a `fastvideo/` model containing `fasth3`, names `MiniMaxAI/MiniMax-H3`
as its base if it names one, and its declared tensor counts match the file. The sparse-attention variants (`.set_weight`
tensors) and bundles with an `adapter_manifest.json` are refused.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from h3serve.adapters.header import AdapterError, SafetensorsHeader, read_header
from h3serve.adapters.weight_edits import WeightEdits

FORMAT = "fastvideo-lora-v2"
BASE_MODEL = "MiniMaxAI/MiniMax-H3"
MANIFEST = "adapter_manifest.json"
# Its pinned schedule: sigma positions before the checkpoint's shifts, 4 forwards, text-to-video+audio only.
POSITIONS = (0.999, 0.749, 0.5, 0.25, 0.0)
FORWARDS = 4
_LORA = re.compile(r"^(?P<module>.+)\.lora_(?P<half>[AB])\.weight$")


@dataclass(frozen=True)
class FastH3File(WeightEdits):
    """A checked FastH3 file: which tensors edit which parameter (scale 1), and the model it names."""

    model: str = ""


def adapter_path(path: str | Path) -> Path:
    """A FastH3 file, or a directory's one .safetensors file; a manifest bundle is refused."""
    path = Path(path)
    if path.is_dir():
        if (path / MANIFEST).exists():
            raise AdapterError(f"{path.name}: a bundle with {MANIFEST} (several adapters) is not supported; give one")
        files = sorted(path.glob("*.safetensors"))
        if len(files) != 1:
            raise AdapterError(f"{path.name}: a FastH3 directory holds exactly one .safetensors file, not {len(files)}")
        return files[0]
    if not path.is_file():
        raise AdapterError(f"{path.name}: no such adapter file or directory")
    return path


def claims(header: SafetensorsHeader) -> bool:
    """Whether the metadata says this is a FastVideo adapter (then it must pass every identity check)."""
    return header.metadata.get("format") == FORMAT


def _count(header: SafetensorsHeader, key: str, actual: int) -> None:
    declared = header.metadata.get(key)
    if declared is None:
        raise AdapterError(f"{header.path.name}: the metadata does not declare {key}")
    if not declared.strip().isdigit() or int(declared) != actual:
        raise AdapterError(f"{header.path.name}: metadata {key} = {declared}, the file holds {actual}")


def inspect_fasth3(header: SafetensorsHeader) -> FastH3File:
    """Check a FastH3 file's identity, counts and tensor names; `AdapterError` with the reason."""
    name, meta = header.path.name, header.metadata
    if meta.get("format") != FORMAT:
        raise AdapterError(f"{name}: metadata format {meta.get('format')!r}; a FastH3 adapter is {FORMAT}")
    model = meta.get("finetuned_model", "")
    if not model.startswith("fastvideo/") or "fasth3" not in model.lower():
        raise AdapterError(f"{name}: metadata finetuned_model {model!r} is not a fastvideo/ FastH3 model")
    if "base_model" in meta and meta["base_model"] != BASE_MODEL:
        raise AdapterError(f"{name}: metadata base_model {meta['base_model']!r}; FastH3 adapts {BASE_MODEL}")
    keys = list(header.tensors)
    set_weight = [k for k in keys if k.endswith(".set_weight")]
    lora = [k for k in keys if _LORA.match(k)]
    diff = [k for k in keys if k.endswith(".diff") or k.endswith(".diff_b")]
    _count(header, "low_rank_tensors", len(lora))
    _count(header, "diff_tensors", len(diff))
    _count(header, "set_weight_tensors", len(set_weight))
    if set_weight:
        raise AdapterError(
            f"{name}: {len(set_weight)} .set_weight tensors (a sparse-attention variant with new gate parameters); "
            "only the dense FastH3 adapter is supported"
        )
    other = sorted(set(keys) - set(lora) - set(diff))
    if other:
        raise AdapterError(f"{name}: tensor {other[0]!r} is not a lora_A/lora_B, .diff or .diff_b tensor")
    pairs: dict[str, dict[str, str]] = {}
    for key in lora:
        m = _LORA.match(key)
        pairs.setdefault(f"{m['module']}.weight", {})[m["half"]] = key
    for param, pair in pairs.items():
        if len(pair) != 2:
            raise AdapterError(f"{name}: {param.removesuffix('.weight')!r} lacks one of lora_A / lora_B")
    diffs = {}
    for key in diff:
        weight = key.endswith(".diff")
        diffs[key.removesuffix(".diff") + ".weight" if weight else key.removesuffix(".diff_b") + ".bias"] = key
    low_rank = {p: (v["A"], v["B"]) for p, v in sorted(pairs.items())}
    return FastH3File(header.path, low_rank, diffs, model=model)


def read_fasth3(path: str | Path) -> FastH3File:
    return inspect_fasth3(read_header(adapter_path(path)))


def is_fasth3_path(path: str | Path) -> bool:
    """Whether `path` (a file or a directory with one .safetensors) claims to be a FastVideo adapter."""
    try:
        return claims(read_header(adapter_path(path)))
    except AdapterError:
        return False


def check_against(adapter: FastH3File, shapes: dict[str, tuple[int, ...]], blocks: list[str]) -> None:
    """Every edit names a parameter of the DiT with a matching shape, and every block is edited."""
    name = adapter.path.name
    header = read_header(adapter.path)
    for param, (key_a, key_b) in adapter.low_rank.items():
        if param not in shapes:
            raise AdapterError(f"{name}: {key_a!r} maps to {param!r}, which is not a parameter of the DiT")
        a, b = header.tensors[key_a].shape, header.tensors[key_b].shape
        if len(a) != 2 or len(b) != 2 or a[0] != b[1] or (b[0], a[1]) != tuple(shapes[param]):
            raise AdapterError(f"{name}: {key_b!r} @ {key_a!r} is {list(b)} @ {list(a)}, not {list(shapes[param])}")
    for param, key in adapter.diffs.items():
        if param not in shapes:
            raise AdapterError(f"{name}: {key!r} maps to {param!r}, which is not a parameter of the DiT")
        if header.tensors[key].shape != tuple(shapes[param]):
            shape = list(header.tensors[key].shape)
            raise AdapterError(f"{name}: {key!r} has shape {shape}, not {list(shapes[param])}")
    untouched = [b for b in blocks if not any(p.startswith(b + ".") for p in adapter.edited)]
    if untouched:
        raise AdapterError(f"{name}: edits no tensor of {untouched[0]} ({len(untouched)} blocks unedited); "
                           "a FastH3 adapter edits every block")
