"""Alibaba PAI's PDD 8-step acceleration adapters (`MiniMax-H3-{FL2VA,Ref2VA}-Acc-8Step.safetensors`), checked
from the header alone (torch-free).

A PDD file is not a PEFT LoRA: a rank-64 LoRA on the trunk (`<module>.lora_down` [r, in] and `<module>.lora_up`
[out, r], no `.weight`) over the attention q/k/v/out, both FFN projections and the per-block AdaLN projection
(`adaln_proj.linear`) of every transformer block, and the same minus AdaLN on the token refiner's blocks; plus a
bank of `pdd_num_steps` (32) output heads for each modality (`proj_out.weight` [32, 96, H], `.bias` [32, 96],
`audio_proj_out.weight` [32, 32, H], `.bias` [32, 32], fp32). Forward k of the pinned schedule (32 / block 4 = 8
forwards, shifts 12 / 3) runs the heads 4k..4k+3 fused by their share of the block's step on the 32-step grid
(`head_plans`). The FFN input's `lora_up` is in diffusers' [value; gate] order, as h3serve's weight is.

Which DiT a file belongs to: the metadata's `key_format` (`minimax-h3-pdd-fl2va` / `-ref2va`), else the released
file name; the two variants are structurally identical, so anything else is refused. A file is a PDD file when its
`proj_out.weight` is a 3-D bank.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from h3serve.adapters.header import AdapterError, SafetensorsHeader
from h3serve.adapters.peft import LoraFile, block_prefixes, target_shapes
from h3serve.rules.adapter_choice import PddContract

DOWN, UP = ".lora_down", ".lora_up"
ADALN = "adaln_proj.linear"
VARIANTS = {  # key_format -> (variant, released file name)
    "minimax-h3-pdd-fl2va": ("fl2va", "MiniMax-H3-FL2VA-Acc-8Step.safetensors"),
    "minimax-h3-pdd-ref2va": ("ref2va", "MiniMax-H3-Ref2VA-Acc-8Step.safetensors"),
}
DEFAULT_STEPS, DEFAULT_BLOCK, DEFAULT_RANK = 32, 4, 64
VIDEO_SHIFT, AUDIO_SHIFT = 12.0, 3.0


def is_pdd(header: SafetensorsHeader) -> bool:
    """A PDD file: a 3-D head bank on the video head (whatever its name)."""
    bank = header.tensors.get("proj_out.weight")
    return bank is not None and len(bank.shape) == 3


def pdd_target_shapes(dit_config: dict) -> dict[str, tuple[int, int]]:
    """(out, in) of every PDD trunk target: the PEFT targets plus each transformer block's AdaLN projection."""
    shapes = dict(target_shapes(dit_config))
    adaln = (18 * int(dit_config["hidden_size"]), int(dit_config.get("time_embed_dim", 0)))  # 6 x 3 modalities
    for block in block_prefixes(dit_config):
        if block.startswith("transformer_blocks."):
            shapes[f"{block}.{ADALN}"] = adaln
    return shapes


def head_outputs(dit_config: dict) -> dict[str, int]:
    """Each head's output features (the diffusers config's defaults where it leaves them out: 24 latent channels
    in 2x2 patches, 32 audio channels)."""
    return {"proj_out": 4 * int(dit_config.get("in_channels", 24)),
            "audio_proj_out": int(dit_config.get("audio_in_channels", 32))}


def _variant(header: SafetensorsHeader) -> tuple[str, str]:
    name = header.path.name
    fmt = header.metadata.get("key_format")
    if fmt is not None:
        if fmt not in VARIANTS:
            raise AdapterError(f"{name}: metadata key_format {fmt!r}; a PDD file's is one of {', '.join(VARIANTS)}")
        return VARIANTS[fmt][0], fmt
    for fmt, (variant, file_name) in VARIANTS.items():
        if name == file_name:
            return variant, fmt
    released = " or ".join(file_name for _, file_name in VARIANTS.values())
    raise AdapterError(
        f"{name}: a PDD file (a head bank) without key_format metadata and not named {released}; the FL2VA and "
        "Ref2VA files are alike in shape, so the name or key_format must say which DiT it belongs to"
    )


def _metadata_int(header: SafetensorsHeader, key: str, default: int) -> int:
    text = header.metadata.get(key)
    if text is None:
        return default
    try:
        value = int(text)
    except ValueError:
        raise AdapterError(f"{header.path.name}: metadata {key} must be an integer, got {text!r}") from None
    if value < 1:
        raise AdapterError(f"{header.path.name}: metadata {key} must be positive, got {value}")
    return value


@dataclass(frozen=True)
class PddFile:
    """A checked PDD file: its trunk LoRA (as a `LoraFile`: target -> (down, up) keys) and what it promises."""

    lora: LoraFile
    contract: PddContract


def inspect_pdd(header: SafetensorsHeader, dit_config: dict) -> PddFile:
    """Check every tensor of a PDD file against the DiT; `AdapterError` naming the first missing, extra,
    duplicated or mis-shaped key."""
    name = header.path.name
    variant, fmt = _variant(header)
    steps = _metadata_int(header, "pdd_num_steps", DEFAULT_STEPS)
    block = _metadata_int(header, "pdd_block_size", DEFAULT_BLOCK)
    if steps % block:
        raise AdapterError(f"{name}: pdd_num_steps {steps} is not a multiple of pdd_block_size {block}")
    shapes = pdd_target_shapes(dit_config)
    hidden = int(dit_config["hidden_size"])
    outs = head_outputs(dit_config)
    bank = {f"{head}.weight": (steps, out, hidden) for head, out in outs.items()}
    bank |= {f"{head}.bias": (steps, out) for head, out in outs.items()}
    halves: dict[str, dict[str, str]] = {}
    ranks: set[int] = set()
    for key, info in header.tensors.items():
        if key in bank:
            if info.shape != bank[key]:
                raise AdapterError(f"{name}: {key} has shape {list(info.shape)}, expected {list(bank[key])}")
            continue
        half = "down" if key.endswith(DOWN) else "up" if key.endswith(UP) else None
        if half is None:
            raise AdapterError(f"{name}: tensor {key!r} is neither a lora_down/lora_up factor nor a head bank")
        target = key[: -len(DOWN if half == "down" else UP)]
        if target not in shapes:
            raise AdapterError(f"{name}: tensor {key!r} targets {target!r}, which is not a PDD target of this DiT")
        out_f, in_f = shapes[target]
        if len(info.shape) != 2:
            raise AdapterError(f"{name}: tensor {key!r} has shape {list(info.shape)}, expected a matrix")
        rank, other = (info.shape[0], info.shape[1]) if half == "down" else (info.shape[1], info.shape[0])
        if other != (in_f if half == "down" else out_f):
            want = f"[r, {in_f}]" if half == "down" else f"[{out_f}, r]"
            raise AdapterError(f"{name}: tensor {key!r} has shape {list(info.shape)}, expected {want}")
        halves.setdefault(target, {})[half] = key
        ranks.add(rank)
    missing = [key for key in bank if key not in header.tensors]
    missing += [f"{t}{DOWN if h == 'down' else UP}" for t in shapes for h in ("down", "up")
                if h not in halves.get(t, {})]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise AdapterError(f"{name}: a PDD file lacks {missing[0]}{more}")
    if len(ranks) != 1:
        raise AdapterError(f"{name}: the targets' ranks differ ({sorted(ranks)}); a PDD file has one rank")
    rank = ranks.pop()
    alpha_text = header.metadata.get("lora_alpha")
    alpha = float(rank) if alpha_text is None else float(alpha_text)
    if not math.isfinite(alpha) or alpha <= 0:
        raise AdapterError(f"{name}: metadata lora_alpha must be a positive number, got {alpha_text!r}")
    keys = {target: (pair["down"], pair["up"]) for target, pair in sorted(halves.items())}
    lora = LoraFile(header.path, rank, alpha, "metadata" if alpha_text else "default", keys, header.nbytes)
    contract = PddContract(name, variant, fmt, steps // block, block, steps, VIDEO_SHIFT, AUDIO_SHIFT)
    return PddFile(lora, contract)


def head_plans(contract: PddContract, shift: float) -> list[list[float]]:
    """Per forward k, the weight of each of the bank's heads (a row of `steps` numbers; only the block's four are
    non-zero, summing to 1): each head's step on the `steps`-step grid t = 1 - shift·σ / (1 + (shift - 1)·σ),
    σ = linspace(1, 0, steps + 1), over the block's whole step. Computed in float64."""
    steps, block = contract.bank_steps, contract.block
    sigmas = [1.0 - i / steps for i in range(steps + 1)]
    t = [1.0 - shift * s / (1.0 + (shift - 1.0) * s) for s in sigmas]
    dt = [t[i + 1] - t[i] for i in range(steps)]
    plans = []
    for k in range(contract.forwards):
        span = sum(dt[k * block : (k + 1) * block])
        plans.append([dt[j] / span if k * block <= j < (k + 1) * block else 0.0 for j in range(steps)])
    return plans
