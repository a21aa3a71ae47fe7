"""Deterministic synthetic DiT adapters in each served layout, for the tiny presets and tests.

`peft`: diffusers/PEFT keys (`<module>.lora_A.weight`), alpha in the metadata. `turbo`: LightX2V's keys
(`<module>.lora_A.default.weight`) under a contract file name. `fasth3`: FastVideo's fused-at-load export (B@A
pairs, `.diff` and `.diff_b` tensors, identity and counts in the metadata). `pdd`: Alibaba PAI's 8-step file
(`lora_down`/`lora_up` on the trunk and the blocks' AdaLN, a 32-head bank per modality, the released name and
metadata). `controlnet`: a Fun ControlNet Union file (control blocks, no key prefix). `taomate`: TaoMate-H3's
causal-streaming LoRA directory (`lora_a`/`lora_b` on the native names, rank and alpha in its config.json).
`flashgen`: FlashGen's native 4-step LoRA (`transformer.<native target>.lora_A.default.weight`, grouped QKV, the
blocks' and the final layer's AdaLN, its metadata: key_format, qkv_layout, rank, alpha, tasks, base_schedule). Same
arguments give the same bytes.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import torch

from h3serve.adapters.peft import target_shapes

FORMATS = ("peft", "turbo", "fasth3", "pdd", "controlnet", "taomate", "flashgen")
CONTROLNET_FILE = "MiniMax-H3-Fun-Controlnet-Union.safetensors"
TURBO_FILE = "minimax_h3_fl2v_turbo_4step_v1.0.safetensors"
PEFT_FILE = "adapter_model.safetensors"


def save_file(tensors: dict[str, torch.Tensor], path: str, metadata: dict[str, str] | None = None) -> None:
    """A safetensors file with a byte-stable header (sorted keys; the library orders metadata at random)."""
    header: dict = {"__metadata__": dict(sorted((metadata or {}).items()))} if metadata else {}
    blobs, offset = [], 0
    for name in sorted(tensors):
        t = tensors[name].detach().to(torch.float32).contiguous()
        data = t.numpy().astype("<f4").tobytes()
        header[name] = {"dtype": "F32", "shape": list(t.shape), "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for blob in blobs:
            f.write(blob)


def _normal(shape: tuple[int, ...], generator: torch.Generator, std: float) -> torch.Tensor:
    return (torch.randn(shape, generator=generator) * std).contiguous()


def lora_tensors(
    dit_config: dict, rank: int, seed: int, std: float = 0.05, suffix: str = "", targets: list[str] | None = None
) -> dict[str, torch.Tensor]:
    """`<module>.lora_A<suffix>.weight` [r, in] and `.lora_B<suffix>.weight` [out, r] for every target, in order."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for module, (out_f, in_f) in target_shapes(dit_config).items():
        if targets is not None and module not in targets:
            continue
        out[f"{module}.lora_A{suffix}.weight"] = _normal((rank, in_f), g, std)
        out[f"{module}.lora_B{suffix}.weight"] = _normal((out_f, rank), g, std)
    return out


def write_peft_adapter(
    folder: str | Path, dit_config: dict, rank: int = 4, alpha: float = 8.0, seed: int = 0, std: float = 0.05
) -> Path:
    """A PEFT-layout adapter directory (adapter_model.safetensors, alpha in its metadata); returns the file."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / PEFT_FILE
    save_file(lora_tensors(dit_config, rank, seed, std), str(path), metadata={"alpha": f"{alpha:g}"})
    return path


def write_turbo_adapter(
    folder: str | Path,
    dit_config: dict,
    rank: int = 8,
    seed: int = 0,
    std: float = 0.05,
    file_name: str = TURBO_FILE,
    alpha: float | None = None,
) -> Path:
    """A LightX2V Turbo-layout file named by its contract (no alpha metadata unless given: LightX2V's 8)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / file_name
    metadata = {"key_format": "minimax-h3-diffusers"}
    if alpha is not None:
        metadata["alpha"] = f"{alpha:g}"
    save_file(lora_tensors(dit_config, rank, seed, std, suffix=".default"), str(path), metadata=metadata)
    return path


FASTH3_FILE = "fasth3_dmd2_4step.safetensors"


def fasth3_tensors(dit_config: dict, rank: int, seed: int, std: float = 0.05) -> dict[str, torch.Tensor]:
    """FastVideo's export: lora_A/lora_B on every LoRA target, a `.diff` on each block's norms and the output
    head, a `.diff_b` on the output head's and time embedder's biases."""
    from h3serve.adapters.peft import block_prefixes

    g = torch.Generator().manual_seed(seed)
    out = lora_tensors(dit_config, rank, seed, std)
    d = int(dit_config["hidden_size"])
    for block in block_prefixes(dit_config):
        out[f"{block}.norm1.diff"] = _normal((d,), g, std)
        out[f"{block}.norm2.diff"] = _normal((d,), g, std)
    patch = int(dit_config.get("in_channels", 24)) * 4
    out["proj_out.diff"] = _normal((patch, d), g, std)
    out["proj_out.diff_b"] = _normal((patch,), g, std)
    out["time_embedder.linear_1.diff_b"] = _normal((int(dit_config.get("time_embed_hidden_dim", d)),), g, std)
    return out


def fasth3_metadata(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    """The identity and counts FastVideo's export writes."""
    keys = list(tensors)
    return {
        "format": "fastvideo-lora-v2",
        "finetuned_model": "fastvideo/FastH3-tiny-synthetic",
        "base_model": "MiniMaxAI/MiniMax-H3",
        "low_rank_tensors": str(sum(".lora_A." in k or ".lora_B." in k for k in keys)),
        "diff_tensors": str(sum(k.endswith(".diff") or k.endswith(".diff_b") for k in keys)),
        "set_weight_tensors": str(sum(k.endswith(".set_weight") for k in keys)),
    }


def write_fasth3_adapter(folder: str | Path, dit_config: dict, rank: int = 4, seed: int = 0, std: float = 0.05) -> Path:
    """A FastH3-layout file (fused at load: `--dit-adapter`)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / FASTH3_FILE
    tensors = fasth3_tensors(dit_config, rank, seed, std)
    save_file(tensors, str(path), metadata=fasth3_metadata(tensors))
    return path


def write_pdd_adapter(
    folder: str | Path, dit_config: dict, rank: int = 4, seed: int = 0, std: float = 0.05, variant: str = "fl2va"
) -> Path:
    """A PDD-layout file under its released name, with the metadata the release carries (`pdd_num_steps` 32,
    `pdd_block_size` 4, rank, alpha = rank, the targets, `key_format`); the head bank around the DiT's own scale."""
    from h3serve.adapters.pdd import DEFAULT_BLOCK, DEFAULT_STEPS, VARIANTS, head_outputs, pdd_target_shapes

    fmt, file_name = next((fmt, name) for fmt, (v, name) in VARIANTS.items() if v == variant)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for module, (out_f, in_f) in pdd_target_shapes(dit_config).items():
        tensors[f"{module}.lora_down"] = _normal((rank, in_f), g, std)
        tensors[f"{module}.lora_up"] = _normal((out_f, rank), g, std)
    d = int(dit_config["hidden_size"])
    for head, out_f in head_outputs(dit_config).items():
        tensors[f"{head}.weight"] = _normal((DEFAULT_STEPS, out_f, d), g, d**-0.5)
        tensors[f"{head}.bias"] = _normal((DEFAULT_STEPS, out_f), g, std)
    metadata = {
        "key_format": fmt, "pdd_num_steps": str(DEFAULT_STEPS), "pdd_block_size": str(DEFAULT_BLOCK),
        "lora_rank": str(rank), "lora_alpha": str(rank),
        "lora_targets": "attn.to_q,attn.to_k,attn.to_v,attn.to_out.0,ff.net.0.proj,ff.net.2,adaln_proj.linear",
    }
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / file_name
    save_file(tensors, str(path), metadata=metadata)
    return path


def write_controlnet(folder: str | Path, dit_config: dict, blocks: int = 3, seed: int = 0, std: float = 0.1) -> Path:
    """A Fun ControlNet Union file in the released layout (keys without a prefix) for the DiT of `dit_config`:
    `blocks` control blocks, seeded N(0, std) weights around unit norms."""
    from h3serve.model.controlnet import ControlNet
    from h3serve.model.transformer_config import H3TransformerConfig

    cfg = H3TransformerConfig(**{k: v for k, v in dit_config.items() if not k.startswith("_")})
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in ControlNet(cfg, blocks).state_dict().items()}
    g = torch.Generator().manual_seed(seed)
    tensors = {k: (1.0 + _normal(shape, g, std)) if "norm" in k else _normal(shape, g, std)
               for k, shape in sorted(shapes.items())}
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / CONTROLNET_FILE
    save_file(tensors, str(path))
    return path


def write_taomate_adapter(
    folder: str | Path, dit_config: dict, rank: int = 4, alpha: float | None = None, seed: int = 0, std: float = 0.05
) -> Path:
    """A TaoMate-H3 LoRA directory in the released layout (`adapter_model.safetensors` with `<native target>.lora_a`
    [r, in] / `.lora_b` [out, r] for every refiner and transformer block × qkv/out/fc1/fc2, and config.json with
    `rank` and `alpha`, alpha = rank unless given, as released); returns the directory."""
    from h3serve.adapters.taomate import WEIGHTS_FILE, native_shapes

    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for target, (out_f, in_f) in native_shapes(dit_config).items():
        tensors[f"{target}.lora_a"] = _normal((rank, in_f), g, std)
        tensors[f"{target}.lora_b"] = _normal((out_f, rank), g, std)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / WEIGHTS_FILE))
    config = {"rank": rank, "alpha": float(rank if alpha is None else alpha)}
    (folder / "config.json").write_text(json.dumps(config, sort_keys=True) + "\n")
    return folder


def write_flashgen_adapter(
    folder: str | Path, dit_config: dict, rank: int = 4, seed: int = 0, std: float = 0.05,
    base_schedule: str = "1.0,0.7,0.4,0.15,0.0", tasks: str = "t2va",
) -> Path:
    """A FlashGen-layout file under its released name: native keys with the `transformer.` prefix and PEFT's
    `.default`, every block's qkv/out/fc1/fc2/AdaLN, the refiner's first four and the final layer's AdaLN, alpha =
    rank as released; the metadata FlashGen ships."""
    from h3serve.adapters.flashgen import KEY_FORMAT as FLASHGEN_KEYS
    from h3serve.adapters.flashgen import PREFIX, QKV_LAYOUT, RELEASED_FILE, SUFFIX_A, SUFFIX_B, native_shapes

    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for target, (out_f, in_f) in native_shapes(dit_config).items():
        tensors[f"{PREFIX}{target}{SUFFIX_A}"] = _normal((rank, in_f), g, std)
        tensors[f"{PREFIX}{target}{SUFFIX_B}"] = _normal((out_f, rank), g, std)
    metadata = {"key_format": FLASHGEN_KEYS, "qkv_layout": QKV_LAYOUT, "lora_rank": str(rank),
                "lora_alpha": str(rank), "tasks": tasks, "base_schedule": base_schedule}
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / RELEASED_FILE
    save_file(tensors, str(path), metadata=metadata)
    return path


DEFAULT_RANKS = {"peft": 4, "turbo": 8, "fasth3": 4, "pdd": 4, "controlnet": 0, "taomate": 4, "flashgen": 4}


def make_tiny_adapter(
    folder: str | Path, fmt: str, preset: str = "tiny", seed: int = 0, rank: int | None = None
) -> Path:
    """A synthetic adapter of `fmt` for the DiT of a tiny-checkpoint preset; returns the file written (the
    directory for `taomate`)."""
    from h3serve.tools.tiny.make_checkpoint import PRESETS

    if fmt not in FORMATS:
        raise ValueError(f"--format {fmt}: choose from: {', '.join(FORMATS)}")
    if preset not in PRESETS:
        raise ValueError(f"--preset {preset}: choose from: {', '.join(PRESETS)}")
    if fmt == "controlnet":
        return write_controlnet(folder, dict(PRESETS[preset].transformer), seed=seed)
    rank = DEFAULT_RANKS[fmt] if rank is None else rank
    if rank < 1:
        raise ValueError(f"--rank must be >= 1, got {rank}")
    cfg = dict(PRESETS[preset].transformer)
    if fmt == "peft":
        return write_peft_adapter(folder, cfg, rank=rank, alpha=float(rank), seed=seed)
    if fmt == "turbo":
        return write_turbo_adapter(folder, cfg, rank=rank, seed=seed)
    if fmt == "pdd":
        return write_pdd_adapter(folder, cfg, rank=rank, seed=seed)
    if fmt == "taomate":
        return write_taomate_adapter(folder, cfg, rank=rank, seed=seed)
    if fmt == "flashgen":
        return write_flashgen_adapter(folder, cfg, rank=rank, seed=seed)
    return write_fasth3_adapter(folder, cfg, rank=rank, seed=seed)
