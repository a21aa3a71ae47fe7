"""The diffusers/PEFT LoRA export layout, checked from the header alone (torch-free).

Keys: `<module>.lora_A[.default].weight` [r, in] and `<module>.lora_B[.default].weight` [out, r], optionally under
a `transformer.` or `base_model.model.` prefix. Targets: the attention q/k/v/out projections and both feed-forward
projections of every transformer and token-refiner block. Alpha: the file's metadata (`alpha` / `lora_alpha`),
else `adapter_config.json` beside it (`lora_alpha`), else the caller's default (alpha = rank: scale 1 per unit).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

from h3serve.adapters.header import AdapterError, SafetensorsHeader

TARGETS = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "ff.net.0.proj", "ff.net.2")
_KEY = re.compile(r"^(?:base_model\.model\.|transformer\.)?(?P<module>.+)\.lora_(?P<half>[AB])(?:\.default)?\.weight$")
_CONFIG_KEYS = (
    "hidden_size", "num_attention_heads", "attention_head_dim", "ffn_dim", "num_layers", "num_refiner_layers"
)


def block_prefixes(dit_config: dict) -> list[str]:
    """Every block's module path: the transformer blocks, then the token refiner's."""
    missing = [k for k in _CONFIG_KEYS if k not in dit_config]
    if missing:
        raise AdapterError(f"the DiT's config.json lacks {', '.join(missing)}")
    main = [f"transformer_blocks.{i}" for i in range(int(dit_config["num_layers"]))]
    return main + [f"token_refiner.refiner_blocks.{i}" for i in range(int(dit_config["num_refiner_layers"]))]


def target_shapes(dit_config: dict) -> dict[str, tuple[int, int]]:
    """(out, in) of every LoRA target of the DiT described by its diffusers `config.json` dict."""
    d = int(dit_config.get("hidden_size", 0))
    inner = int(dit_config.get("num_attention_heads", 0)) * int(dit_config.get("attention_head_dim", 0))
    ffn = int(dit_config.get("ffn_dim", 0))
    per_block = {
        "attn.to_q": (inner, d),
        "attn.to_k": (inner, d),
        "attn.to_v": (inner, d),
        "attn.to_out.0": (d, inner),
        "ff.net.0.proj": (2 * ffn, d),  # [value; gate]
        "ff.net.2": (d, ffn),
    }
    return {f"{block}.{t}": shape for block in block_prefixes(dit_config) for t in TARGETS for shape in [per_block[t]]}


@dataclass(frozen=True)
class LoraFile:
    """A checked LoRA file: which tensor holds each target's factors, its rank and alpha."""

    path: Path
    rank: int
    alpha: float
    alpha_source: str  # "metadata" | "adapter_config.json" | "default"
    keys: dict[str, tuple[str, str]]  # target module -> (lora_A key, lora_B key)
    nbytes: int

    @property
    def unit_scale(self) -> float:
        """alpha / r: the factor one unit of request scale stands for."""
        return self.alpha / self.rank


def _alpha(header: SafetensorsHeader) -> tuple[float | None, str]:
    for key in ("alpha", "lora_alpha"):
        if key in header.metadata:
            return _number(header.metadata[key], f"{header.path.name}: metadata {key}"), "metadata"
    config = header.path.parent / "adapter_config.json"
    if config.is_file():
        try:
            data = json.loads(config.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise AdapterError(f"{config.name}: cannot be read as JSON ({e})") from None
        if isinstance(data, dict) and "lora_alpha" in data:
            return _number(data["lora_alpha"], f"{config.name}: lora_alpha"), "adapter_config.json"
    return None, "default"


def _number(value: object, what: str) -> float:
    try:
        number = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise AdapterError(f"{what} must be a number, got {value!r}") from None
    if not math.isfinite(number) or number <= 0:
        raise AdapterError(f"{what} must be a positive number, got {value!r}")
    return number


def inspect_lora(
    header: SafetensorsHeader, shapes: dict[str, tuple[int, int]], default_alpha: float | None = None
) -> LoraFile:
    """Check every tensor of a LoRA file against the DiT's targets; `AdapterError` naming the first bad key.

    `default_alpha` applies when neither the metadata nor adapter_config.json give one (None: alpha = rank)."""
    name = header.path.name
    halves: dict[str, dict[str, str]] = {}
    ranks: set[int] = set()
    for key, info in header.tensors.items():
        m = _KEY.match(key)
        if m is None:
            raise AdapterError(f"{name}: tensor {key!r} is not a lora_A/lora_B weight")
        module, half = m["module"], m["half"]
        if module not in shapes:
            raise AdapterError(
                f"{name}: tensor {key!r} targets {module!r}, which is not a LoRA target of this DiT "
                f"(targets: {', '.join(TARGETS)} of every transformer and token-refiner block)"
            )
        if len(info.shape) != 2:
            raise AdapterError(f"{name}: tensor {key!r} has shape {list(info.shape)}, expected a matrix")
        out_f, in_f = shapes[module]
        rank = info.shape[0] if half == "A" else info.shape[1]
        other = info.shape[1] if half == "A" else info.shape[0]
        expected = in_f if half == "A" else out_f
        if other != expected or rank < 1:
            want = f"[r, {in_f}]" if half == "A" else f"[{out_f}, r]"
            raise AdapterError(f"{name}: tensor {key!r} has shape {list(info.shape)}, expected {want}")
        if half in halves.setdefault(module, {}):
            raise AdapterError(f"{name}: {module!r} has two lora_{half} tensors")
        halves[module][half] = key
        ranks.add(rank)
    if not halves:
        raise AdapterError(f"{name}: no lora_A/lora_B tensors")
    for module, pair in halves.items():
        if len(pair) != 2:
            lacking = "lora_B" if "A" in pair else "lora_A"
            raise AdapterError(f"{name}: {module!r} has no {lacking} tensor (both halves of a target are needed)")
    if len(ranks) != 1:
        raise AdapterError(f"{name}: the targets' ranks differ ({sorted(ranks)}); one rank per file is supported")
    rank = ranks.pop()
    alpha, source = _alpha(header)
    if alpha is None:
        alpha = float(rank) if default_alpha is None else default_alpha
    keys = {module: (pair["A"], pair["B"]) for module, pair in sorted(halves.items())}
    return LoraFile(header.path, rank, alpha, source, keys, header.nbytes)
