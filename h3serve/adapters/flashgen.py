"""FlashGen's native 4-step LoRA for MiniMax-H3 T2VA (ModelScope `FlashGen/Minimax-H3-4step-lora-flashgen`,
`minimax_h3_t2va_flashgen_4step_v1.0_768p_bf16.safetensors`), recognised by its metadata and checked from the
header alone (torch-free).

Metadata: `key_format` minimax-h3-native, `qkv_layout` grouped, `lora_rank` / `lora_alpha` (64 / 64), `tasks`
(t2va) and `base_schedule` (`1.0,0.7,0.4,0.15,0.0`: sigma positions before the shift, exactly 4 intervals).
Keys: `transformer.<target>.lora_A.default.weight` [r, in] and `.lora_B.default.weight` [out, r] on the native
module names: every block's `attn.qkv_proj`, `attn.out_proj`, `mlp.fc1`, `mlp.fc2` and `adaln_proj.linear`, the
token refiner's blocks' first four, and `final_layer.adaln_proj.linear` (259 targets on the released DiT).

On h3serve's (diffusers-named) DiT each native target lands on its modules (`diffusers_parts`): the grouped
`qkv_proj`'s B rows are per head [q, k, v] × head_dim and regroup into the three q / k / v slices, which share A;
`mlp.fc1`'s B is the native [gate; up] and swaps to diffusers' [value(up); gate]; the AdaLN projections keep their
rows (`adaln_proj.linear`, the final layer's `norm_out.linear`). Applied unmerged at scale × alpha / rank
(h3serve.rank.lora), like any per-request LoRA.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from h3serve.adapters.header import AdapterError, SafetensorsHeader
from h3serve.adapters.peft import LoraFile
from h3serve.rules.adapter_choice import FlashGenContract
from h3serve.rules.schedule import check_positions

KEY_FORMAT = "minimax-h3-native"
QKV_LAYOUT = "grouped"
RELEASED_FILE = "minimax_h3_t2va_flashgen_4step_v1.0_768p_bf16.safetensors"
FORWARDS = 4  # base_schedule must hold exactly 4 intervals
PREFIX, SUFFIX_A, SUFFIX_B = "transformer.", ".lora_A.default.weight", ".lora_B.default.weight"
BLOCK_TARGETS = ("attn.qkv_proj", "attn.out_proj", "mlp.fc1", "mlp.fc2", "adaln_proj.linear")
REFINER_TARGETS = BLOCK_TARGETS[:4]
FINAL_TARGET = "final_layer.adaln_proj.linear"
_DIFFUSERS = {"attn.out_proj": "attn.to_out.0", "mlp.fc1": "ff.net.0.proj", "mlp.fc2": "ff.net.2",
              "adaln_proj.linear": "adaln_proj.linear"}


def claims(header: SafetensorsHeader) -> bool:
    """Whether the metadata says this is a native-key LoRA with FlashGen's grouped QKV (it must then pass every
    check)."""
    meta = header.metadata
    return meta.get("key_format") == KEY_FORMAT and "base_schedule" in meta


def native_shapes(dit_config: dict) -> dict[str, tuple[int, int]]:
    """(out, in) of every native target of the DiT its diffusers `config.json` describes, in checkpoint order."""
    d = int(dit_config["hidden_size"])
    inner = int(dit_config["num_attention_heads"]) * int(dit_config["attention_head_dim"])
    ffn, temb = int(dit_config["ffn_dim"]), int(dit_config["time_embed_dim"])
    per = {"attn.qkv_proj": (3 * inner, d), "attn.out_proj": (d, inner), "mlp.fc1": (2 * ffn, d),
           "mlp.fc2": (d, ffn), "adaln_proj.linear": (18 * d, temb)}
    shapes = {f"blocks.{i}.{t}": per[t] for i in range(int(dit_config["num_layers"])) for t in BLOCK_TARGETS}
    for i in range(int(dit_config["num_refiner_layers"])):
        shapes |= {f"token_refiner.blocks.{i}.{t}": per[t] for t in REFINER_TARGETS}
    shapes[FINAL_TARGET] = (2 * d, temb)
    return shapes


@dataclass(frozen=True)
class DiffusersSlice:
    """Where one native target's factors land on h3serve's DiT: the diffusers target, and how its B rows are cut
    from the native B (`qkv`: this part of each head's [q, k, v]; `swap`: the [gate; up] halves swapped)."""

    target: str
    qkv: int | None = None  # 0 q, 1 k, 2 v
    swap: bool = False


def diffusers_parts(native: str) -> tuple[DiffusersSlice, ...]:
    """The diffusers LoRA targets (h3serve.adapters.peft names, plus the AdaLN projections) a native target holds."""
    if native == FINAL_TARGET:
        return (DiffusersSlice("norm_out.linear"),)
    for old, new in (("token_refiner.blocks.", "token_refiner.refiner_blocks."), ("blocks.", "transformer_blocks.")):
        if native.startswith(old):
            block_index, _, kind = native[len(old):].partition(".")
            block = f"{new}{block_index}"
            break
    else:
        raise AdapterError(f"{native}: not a FlashGen LoRA target")
    if kind == "attn.qkv_proj":
        return tuple(DiffusersSlice(f"{block}.attn.to_{p}", qkv=i) for i, p in enumerate("qkv"))
    return (DiffusersSlice(f"{block}.{_DIFFUSERS[kind]}", swap=kind == "mlp.fc1"),)


def _metadata_number(header: SafetensorsHeader, key: str) -> float:
    text = header.metadata.get(key)
    if text is None:
        raise AdapterError(f"{header.path.name}: a FlashGen LoRA declares {key} in its metadata")
    try:
        value = float(text)
    except ValueError:
        raise AdapterError(f"{header.path.name}: metadata {key} must be a number, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise AdapterError(f"{header.path.name}: metadata {key} must be positive, got {text!r}")
    return value


def _schedule(header: SafetensorsHeader) -> tuple[float, ...]:
    name, text = header.path.name, header.metadata["base_schedule"]
    try:
        positions = check_positions([float(p) for p in text.split(",")], f"{name}: metadata base_schedule")
    except ValueError as e:
        raise AdapterError(f"{e} (got {text!r})") from None
    if len(positions) - 1 != FORWARDS:
        raise AdapterError(f"{name}: metadata base_schedule {text!r} holds {len(positions) - 1} intervals; a FlashGen "
                           f"4-step LoRA's holds exactly {FORWARDS}")
    return positions


@dataclass(frozen=True)
class FlashGenFile:
    """A checked FlashGen file: its LoRA (`LoraFile`: native target -> (A, B) keys) and what it promises."""

    lora: LoraFile
    contract: FlashGenContract
    rows: dict[str, int]  # native target -> B's rows (its output features)


def inspect_flashgen(header: SafetensorsHeader, dit_config: dict) -> FlashGenFile:
    """Check a FlashGen file's metadata and every tensor against the DiT; `AdapterError` naming the first missing,
    extra or mis-shaped key."""
    name, meta = header.path.name, header.metadata
    if meta.get("key_format") != KEY_FORMAT:
        raise AdapterError(f"{name}: metadata key_format {meta.get('key_format')!r}; FlashGen's is {KEY_FORMAT}")
    if meta.get("qkv_layout") != QKV_LAYOUT:
        raise AdapterError(f"{name}: metadata qkv_layout {meta.get('qkv_layout')!r}; FlashGen's fused QKV is "
                           f"{QKV_LAYOUT} (per head [q, k, v]), which is what the regrouping reads")
    positions = _schedule(header)
    rank_value, alpha = _metadata_number(header, "lora_rank"), _metadata_number(header, "lora_alpha")
    if rank_value != int(rank_value):
        raise AdapterError(f"{name}: metadata lora_rank must be an integer, got {meta['lora_rank']!r}")
    rank = int(rank_value)
    tasks = tuple(t.strip() for t in meta.get("tasks", "t2va").split(",") if t.strip())
    if not tasks or any(t not in ("t2va", "fl2va") for t in tasks):
        raise AdapterError(f"{name}: metadata tasks {meta.get('tasks')!r}; a FlashGen LoRA adapts the FL2VA DiT "
                           "(t2va, fl2va), never Ref2VA")
    shapes = native_shapes(dit_config)
    expected = {f"{PREFIX}{t}{s}": (t, s) for t in shapes for s in (SUFFIX_A, SUFFIX_B)}
    extra = sorted(set(header.tensors) - set(expected))
    missing = sorted(set(expected) - set(header.tensors))
    if extra or missing:
        first = f"has the unexpected tensor {extra[0]!r}" if extra else f"lacks {missing[0]}"
        raise AdapterError(f"{name}: {first} ({len(missing)} missing, {len(extra)} unexpected; a FlashGen LoRA has "
                           f"{len(shapes)} targets on this DiT, each with lora_A and lora_B)")
    for key, (target, suffix) in expected.items():
        out_f, in_f = shapes[target]
        want = (rank, in_f) if suffix == SUFFIX_A else (out_f, rank)
        if header.tensors[key].shape != want:
            raise AdapterError(f"{name}: {key} has shape {list(header.tensors[key].shape)}, expected {list(want)} "
                               f"(rank {rank} from lora_rank)")
    keys = {t: (f"{PREFIX}{t}{SUFFIX_A}", f"{PREFIX}{t}{SUFFIX_B}") for t in shapes}
    lora = LoraFile(header.path, rank, alpha, "metadata", keys, header.nbytes)
    contract = FlashGenContract(name, positions, tasks, rank, alpha)
    return FlashGenFile(lora, contract, {t: out_f for t, (out_f, _) in shapes.items()})
