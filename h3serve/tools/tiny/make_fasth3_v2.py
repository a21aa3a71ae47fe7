"""A tiny FastH3 8-step V2 tree (`make-tiny-checkpoint --layout fasth3-v2`), in FastVideo's export layout: a
diffusers modular root with the distilled T2VA DiT (the tiny modular checkpoint's FL2VA DiT plus seeded video sparse
attention gates, `transformer_blocks.N.attn.to_gate_compress`), the text stack, schedulers at shifts 10 / 3,
`fastvideo_inference.json` (the V2 contract) and `provenance.json` pinning a base revision. Its index names the
VAEs where the release does, in the base repository (`MiniMaxAI/MiniMax-H3`, `FL2VA/video_vae`): served with
`--base-checkpoint` set to the tiny modular checkpoint it was made from. Same source and seed give the same bytes.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from h3serve.checkpoint.fasth3_v2 import BASE_REPO, CONTRACT, INFERENCE_FILE, PROVENANCE_FILE, contract_json
from h3serve.checkpoint.file_reading import INDEX_FILE, safetensors_files
from h3serve.tools.tiny.build_files import make_readable, write_json

# The pinned base snapshot of every tiny V2 tree (a made-up revision: the tiny base is no Hub snapshot).
TINY_BASE_REVISION = "0123456789abcdef0123456789abcdef01234567"
_COPIED = ("text_encoder", "tokenizer", "processor")


def v2_from_modular(modular_dir: str | Path, out_dir: str | Path, seed: int = 0, gate_std: float = 0.1) -> Path:
    """The V2 tree of a built tiny modular checkpoint (whose VAEs serve as its base); returns `out_dir`."""
    from safetensors.torch import load_file, save_file

    src, out = Path(modular_dir), Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"refusing to build a checkpoint into non-empty directory {out}")
    out.mkdir(parents=True, exist_ok=True)
    for name in _COPIED:
        shutil.copytree(src / name, out / name)
    (out / "transformer").mkdir()
    config = json.loads((src / "transformer" / "config.json").read_text())
    write_json(out / "transformer" / "config.json", config)
    tensors: dict[str, torch.Tensor] = {}
    for file in safetensors_files(src / "transformer"):
        tensors.update(load_file(str(file)))
    g = torch.Generator().manual_seed(seed)
    hidden, inner = config["hidden_size"], config["num_attention_heads"] * config["attention_head_dim"]
    for i in range(config["num_layers"]):
        prefix = f"transformer_blocks.{i}.attn.to_gate_compress"
        tensors[f"{prefix}.weight"] = (torch.randn(inner, hidden, generator=g) * gate_std).to(torch.float32)
        tensors[f"{prefix}.bias"] = (torch.randn(inner, generator=g) * gate_std).to(torch.float32)
    save_file({k: tensors[k].contiguous() for k in sorted(tensors)}, str(out / "transformer" /
              "diffusion_pytorch_model.safetensors"), metadata={"format": "pt"})
    for name, shift in (("scheduler", CONTRACT["video_scheduler_shift"]),
                        ("audio_scheduler", CONTRACT["audio_scheduler_shift"])):
        scheduler = json.loads((src / name / "scheduler_config.json").read_text())
        write_json(out / name / "scheduler_config.json", {**scheduler, "shift": shift})
    index = json.loads((src / INDEX_FILE).read_text())
    index.pop("transformer_ref", None)
    for name, subfolder in (("vae", "FL2VA/video_vae"), ("audio_vae", "FL2VA/audio_vae")):
        library, class_name, loading = index[name]
        index[name] = [library, class_name, {**loading, "pretrained_model_name_or_path": BASE_REPO,
                                             "subfolder": subfolder, "revision": TINY_BASE_REVISION}]
    (out / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    (out / INFERENCE_FILE).write_text(contract_json())
    write_json(out / PROVENANCE_FILE, {"base_model_revision": f"hf://{BASE_REPO}@{TINY_BASE_REVISION}"})
    make_readable(out)
    return out
