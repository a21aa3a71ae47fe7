"""Start-up sidecars of the AdaLN memo (`--adaln-cache-dir DIR`): the default schedules' modulations, written
once and read at later start-ups, so the first requests find them in the memo.

One file per DiT and rank, `DIR/<dit>.rank<r>-of-<n>.safetensors`: the entries' tensors and, in the header, a
digest of everything their bits depend on: the time embedder's and AdaLN projections' weights as this rank
holds them, the schedules (every entry's key), the dtype, the device kind and torch's version (another GPU or
build may round differently). A file whose digest is not this engine's is refused, never used: the entries
are computed (exactly as a request would) and the file rewritten. All ranks agree on hit or miss before
anything is computed, so the tensor-parallel projections' collectives pair up.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file

from h3serve.model.adaln_memo import AdaLNMemo, ForwardTimes, MemoEntry, MemoKey, memo_key
from h3serve.model.layout import (
    TEXT_TAG,
    Layout,
    ReferenceBlock,
    build_keyframe_layout,
    build_reference_layout,
)
from h3serve.model.pipeline import H3Pipeline
from h3serve.model.scheduler import FlowSchedule
from h3serve.model.step_times import step_times
from h3serve.model.transformer import H3Transformer
from h3serve.rules.request import GenerationRequest
from h3serve.rules.validate import ModelDefaults, validate

FORMAT = "h3serve-adaln-sidecar-1"
Log = Callable[[str], None]


def default_layouts(dit: str) -> list[Layout]:
    """Small layouts with every row kind a default request of the DiT's tasks has: the memo key depends on the
    timesteps and on which (timestep, modality) rows are read, not on how many rows there are."""
    tags = torch.full((3,), TEXT_TAG)
    if dit == "transformer":  # t2va, fl2va (a keyframe's condition rows at max(t, 0.999))
        return [build_keyframe_layout(tags, 2, 2, 2, 2, ()), build_keyframe_layout(tags, 2, 2, 2, 2, ("first",))]
    image = ReferenceBlock("image", 1, 2, 2)
    audio = ReferenceBlock("audio", audio_latents=2)  # audio reference rows at 1.0
    return [build_reference_layout(tags, blocks, 2, 2, 2, 2) for blocks in ([image], [image, audio])]


def default_steps(
    dit: str, defaults: ModelDefaults, steps: int | None = None
) -> list[tuple[torch.Tensor, list[ForwardTimes]]]:
    """(token tags, every forward's timesteps) of the default request's schedule (its steps, shifts and any
    pinned schedule, as `validate` resolves them; `steps` overrides the count) for each kind of default request
    of the DiT."""
    plan = validate(GenerationRequest(prompt="sidecar", steps=steps), defaults)
    schedules = (
        FlowSchedule.shifted(plan.steps, plan.flow_shift, plan.pinned_positions),
        FlowSchedule.shifted(plan.steps, plan.audio_flow_shift, plan.pinned_positions),
    )
    out = []
    for layout in default_layouts(dit):
        times = step_times(schedules, layout, (None, None), torch.device("cpu"))
        forwards = [ForwardTimes(times.timesteps[i], times.row_index[i]) for i in range(len(times))]
        out.append((layout.packed.token_tags, forwards))
    return out


def _hash_tensor(h: hashlib._Hash, t: torch.Tensor) -> None:
    h.update(str((tuple(t.shape), str(t.dtype))).encode())
    h.update(t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())


def digest(model: H3Transformer, keys: list[MemoKey], scope, device: torch.device) -> str:
    """sha256 of the format, the device kind, torch, the weights the modulations come from, and the keys."""
    h = hashlib.sha256(FORMAT.encode())
    kind = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    h.update(f"{kind}|{torch.__version__}".encode())
    for t in model.time_embedder.state_dict().values():
        _hash_tensor(h, t)
    for module in [*(b.adaln_proj for b in model.transformer_blocks), model.norm_out.linear]:
        with scope(module):
            for t in module.state_dict().values():  # parameters and buffers (a quantised weight's scale)
                _hash_tensor(h, t)
    for key in keys:
        h.update(repr(key).encode())
    return h.hexdigest()


def _read(path: Path, expected: str, keys: list[MemoKey], num_blocks: int) -> tuple[list[MemoEntry] | None, str]:
    """The entries of a sidecar whose digest is `expected`, or None and why not."""
    if not path.is_file():
        return None, "missing"
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            meta = f.metadata() or {}
            if meta.get("format") != FORMAT or meta.get("digest") != expected:
                found = meta.get("digest", "none")[:16]
                return None, f"refused: digest {found} is not this engine's {expected[:16]} (other weights, schedule "
                "or device)"
            entries = []
            for i in range(len(keys)):
                tables = tuple(f.get_tensor(f"{i}.table.{b}") for b in range(num_blocks))
                entries.append(MemoEntry(tables, f.get_tensor(f"{i}.slots"), f.get_tensor(f"{i}.output")))
    except Exception as e:  # a truncated or foreign file is refused like a wrong digest
        return None, f"refused: unreadable ({type(e).__name__}: {e})"
    return entries, "hit"


def _write(path: Path, expected: str, entries: list[MemoEntry]) -> None:
    tensors: dict[str, torch.Tensor] = {}
    for i, e in enumerate(entries):
        tensors |= {f"{i}.table.{b}": t.cpu().contiguous() for b, t in enumerate(e.tables)}
        tensors[f"{i}.slots"] = e.slots.cpu().contiguous()
        tensors[f"{i}.output"] = e.output.cpu().contiguous()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    save_file(tensors, str(tmp), metadata={"format": FORMAT, "digest": expected})
    os.replace(tmp, path)


def _all_agree(hit: bool, device: torch.device) -> bool:
    """True only when every rank has a usable sidecar (a MIN over the world)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return hit
    flag = torch.tensor([int(hit)], device=device if device.type == "cuda" else "cpu")
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def load_sidecars(
    pipeline: H3Pipeline,
    memo: AdaLNMemo,
    folder: Path,
    defaults: ModelDefaults,
    rank: int,
    world: int,
    log: Log,
    steps: int | None = None,
) -> dict[str, str]:
    """Fill `memo` with the default schedules of every loaded DiT from DIR, computing (and writing) what is
    missing or refused. Returns each DiT's outcome: "hit", "missing" or the refusal."""
    outcomes = {}
    hooks, device = pipeline.hooks, pipeline.device
    for name, model in (("transformer", pipeline.components.transformer),
                        ("transformer_ref", pipeline.components.transformer_ref)):  # fmt: skip
        if model is None:
            continue
        requests = default_steps(name, defaults, steps)
        keys = [memo_key(name, model, s, s.slots(tags)) for tags, forwards in requests for s in forwards]
        unique = list(dict.fromkeys(keys))
        path = folder / f"{name}.rank{rank}-of-{world}.safetensors"
        task = "t2va" if name == "transformer" else "ref2va"
        with hooks.request(task), hooks.stage("denoise"):  # the DiT placed as for a request (staged DiTs too)
            expected = digest(model, unique, hooks.weights, device)
            entries, outcomes[name] = _read(path, expected, unique, len(model.transformer_blocks))
            if _all_agree(entries is not None, device):
                for key, entry in zip(unique, entries, strict=True):
                    memo.put(key, entry)
                continue
            if outcomes[name] != "missing":
                log(f"adaln sidecar {path}: {outcomes[name]}; computing it again")
            for tags, forwards in requests:
                memo.prepare(name, model, forwards, tags, device, hooks.weights)
        computed = [memo.get(k) for k in unique]
        if any(e is None for e in computed):
            log(f"adaln sidecar {path}: the memo ({memo.limit_bytes} B) cannot hold the default schedules; not written")
            continue
        _write(path, expected, computed)
    return outcomes
