"""TaoMate-H3's causal-streaming LoRA (`TaoLiveAIGC/TaoMate-H3`), checked from its header and config (torch-free).

The release is a directory: `adapter_model.safetensors` holding `<target>.lora_a` [r, in] and `<target>.lora_b`
[out, r] on the native (MiniMaxAI) module names, `token_refiner.blocks.{0,1}` and `blocks.{0..49}` ×
`attn.qkv_proj`, `attn.out_proj`, `mlp.fc1`, `mlp.fc2`, and beside it `config.json` (or `adapter_config.json`) with
`rank` (or `r`) and `alpha` (or `lora_alpha`), both 128 in the release. The inventory must be exactly that, as
vLLM-Omni's loader requires (`vllm_omni/diffusion/models/taomate_h3/lora.py`).

h3serve's DiT has diffusers' modules, so each native target maps onto them (`diffusers_parts`): the fused
`qkv_proj`'s `lora_b` rows are stacked [Q; K; V] (vLLM-Omni applies them unpermuted to the merged [Q; K; V] base)
and become three parts sharing `lora_a`; `mlp.fc1`'s rows are the native [gate; value] and are swapped to
diffusers' [value; gate]; the other two keep their rows.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from h3serve.adapters.header import AdapterError, read_header

WEIGHTS_FILE = "adapter_model.safetensors"
CONFIG_FILES = ("config.json", "adapter_config.json")
SUFFIXES = ("attn.qkv_proj", "attn.out_proj", "mlp.fc1", "mlp.fc2")
FACTORS = ("lora_a", "lora_b")
_DIFFUSERS = {"attn.out_proj": "attn.to_out.0", "mlp.fc1": "ff.net.0.proj", "mlp.fc2": "ff.net.2"}


def native_targets(num_layers: int, num_refiner_layers: int) -> tuple[str, ...]:
    """Every target of the release's inventory, in checkpoint order (refiner blocks first)."""
    blocks = [f"token_refiner.blocks.{i}" for i in range(num_refiner_layers)]
    blocks += [f"blocks.{i}" for i in range(num_layers)]
    return tuple(f"{block}.{suffix}" for block in blocks for suffix in SUFFIXES)


def native_shapes(dit_config: dict) -> dict[str, tuple[int, int]]:
    """(out, in) of every native target of the DiT its diffusers `config.json` describes."""
    d = int(dit_config["hidden_size"])
    inner = int(dit_config["num_attention_heads"]) * int(dit_config["attention_head_dim"])
    ffn = int(dit_config["ffn_dim"])
    per = {"attn.qkv_proj": (3 * inner, d), "attn.out_proj": (d, inner), "mlp.fc1": (2 * ffn, d), "mlp.fc2": (d, ffn)}
    targets = native_targets(int(dit_config["num_layers"]), int(dit_config["num_refiner_layers"]))
    return {target: per[_kind(target)] for target in targets}


def _kind(target: str) -> str:
    """`blocks.3.attn.qkv_proj` -> `attn.qkv_proj`."""
    return ".".join(target.split(".")[-2:])


@dataclass(frozen=True)
class DiffusersPart:
    """Where one native target's factors land on h3serve's DiT: `lora_b` rows [start, stop), halves swapped or not."""

    target: str  # a diffusers LoRA target (h3serve.adapters.peft.target_shapes' names)
    start: int
    stop: int
    swap_halves: bool = False


def diffusers_parts(native: str, rows: int) -> tuple[DiffusersPart, ...]:
    """The diffusers targets a native target of `rows` output rows holds (three for the fused Q/K/V)."""
    kind = _kind(native)
    block = native[: -len(kind) - 1]
    if kind not in SUFFIXES:
        raise AdapterError(f"{native}: not a TaoMate-H3 LoRA target")
    if block.startswith("token_refiner.blocks."):
        block = "token_refiner.refiner_blocks." + block[len("token_refiner.blocks.") :]
    elif block.startswith("blocks."):
        block = "transformer_blocks." + block[len("blocks.") :]
    else:
        raise AdapterError(f"{native}: not a TaoMate-H3 LoRA target")
    if kind == "attn.qkv_proj":
        third = rows // 3
        return tuple(DiffusersPart(f"{block}.attn.to_{p}", i * third, (i + 1) * third) for i, p in enumerate("qkv"))
    return (DiffusersPart(f"{block}.{_DIFFUSERS[kind]}", 0, rows, swap_halves=kind == "mlp.fc1"),)


@dataclass(frozen=True)
class TaomateAdapter:
    """A checked TaoMate-H3 LoRA directory: its weights file, rank, alpha and each native target's (A, B) keys."""

    folder: Path
    path: Path  # adapter_model.safetensors
    rank: int
    alpha: float
    keys: dict[str, tuple[str, str]]  # native target -> (lora_a key, lora_b key)
    rows: dict[str, int]  # native target -> lora_b rows (its output features)
    nbytes: int

    @property
    def unit_scale(self) -> float:
        """alpha / r: what the layers multiply the low-rank product by."""
        return self.alpha / self.rank


def _config_number(config: dict, names: tuple[str, str], what: str, file: str) -> float:
    value = next((config[n] for n in names if n in config), None)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
        raise AdapterError(f"{file}: {what} ({' or '.join(names)}) must be a positive number, got {value!r}")
    return value


def read_config(folder: Path) -> tuple[int, float]:
    """(rank, alpha) from the directory's config.json, else adapter_config.json."""
    path = next((folder / name for name in CONFIG_FILES if (folder / name).is_file()), None)
    if path is None:
        raise AdapterError(f"{folder.name}: no {' or '.join(CONFIG_FILES)} beside {WEIGHTS_FILE}")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeError, json.JSONDecodeError) as e:
        raise AdapterError(f"{path.name}: cannot be read as JSON ({e})") from None
    if not isinstance(config, dict):
        raise AdapterError(f"{path.name}: must hold a JSON object")
    rank = _config_number(config, ("rank", "r"), "the rank", path.name)
    if rank != int(rank):
        raise AdapterError(f"{path.name}: the rank must be an integer, got {rank!r}")
    return int(rank), float(_config_number(config, ("alpha", "lora_alpha"), "alpha", path.name))


def is_taomate_dir(path: str | Path) -> bool:
    """Whether `path` is a directory in the TaoMate-H3 layout (its weights file holds `.lora_a` keys)."""
    folder = Path(path)
    if not (folder / WEIGHTS_FILE).is_file():
        return False
    try:
        keys = read_header(folder / WEIGHTS_FILE).tensors
    except AdapterError:
        return False
    return any(key.endswith(".lora_a") for key in keys)


def inspect_taomate(path: str | Path, dit_config: dict) -> TaomateAdapter:
    """Check a TaoMate-H3 LoRA directory against the DiT: the exact inventory, every factor's shape and the
    config's rank; `AdapterError` naming the first problem."""
    folder = Path(path)
    if not folder.is_dir():
        raise AdapterError(f"{folder.name}: a TaoMate-H3 LoRA is a directory ({WEIGHTS_FILE} + config.json)")
    file = folder / WEIGHTS_FILE
    if not file.is_file():
        raise AdapterError(f"{folder.name}: no {WEIGHTS_FILE}")
    rank, alpha = read_config(folder)
    header = read_header(file)
    shapes = native_shapes(dit_config)
    expected = {f"{target}.{factor}" for target in shapes for factor in FACTORS}
    present = set(header.tensors)
    if present != expected:
        missing, extra = sorted(expected - present), sorted(present - expected)
        first = f"lacks {missing[0]}" if missing else f"has the unexpected tensor {extra[0]!r}"
        raise AdapterError(
            f"{file.name}: {first} ({len(missing)} missing, {len(extra)} unexpected; the inventory is "
            f"{len(shapes)} targets = the refiner and transformer blocks × {', '.join(SUFFIXES)}, .lora_a/.lora_b)"
        )
    for target, (out_f, in_f) in shapes.items():
        for factor, want in (("lora_a", (rank, in_f)), ("lora_b", (out_f, rank))):
            got = header.tensors[f"{target}.{factor}"].shape
            if got != want:
                raise AdapterError(f"{file.name}: {target}.{factor} has shape {list(got)}, expected {list(want)} "
                                   f"(rank {rank} from the config)")
    keys = {target: (f"{target}.lora_a", f"{target}.lora_b") for target in shapes}
    rows = {target: out_f for target, (out_f, _) in shapes.items()}
    return TaomateAdapter(folder, file, rank, alpha, keys, rows, header.nbytes)
