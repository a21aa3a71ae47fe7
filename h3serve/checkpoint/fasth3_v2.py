"""FastVideo's FastH3 8-step V2 checkpoint (`FastVideo/FastVideo-FastH3-8-Step-V2`): its folder layout, its inference
contract and where its VAEs come from. Torch-free.

The tree is a diffusers modular checkpoint (`modular_model_index.json`) holding the distilled T2VA DiT (with video
sparse attention's gate projections, `attn.to_gate_compress`), the text stack and both schedulers, plus:

- `fastvideo_inference.json`: how it must be sampled (`fasth3-inference-contract-v1`), checked key by key against
  `CONTRACT`: the DMD rungs [999, 874, ..., 125] (sigma positions ÷ 1000, then 0), 8 transformer forwards (9 grid
  points), shifts 10 / 3 (which the scheduler configs must repeat), guidance 1, VSA at sparsity 0.8 in 64-row
  tiles, task t2av. A key missing, unknown or different is refused with the key named.
- `provenance.json`: the base snapshot it was distilled from, `hf://MiniMaxAI/MiniMax-H3@<revision>`, whose FL2VA
  video and audio VAEs it decodes with. h3serve downloads nothing: the VAEs come from a local MiniMax-H3 checkpoint
  named by `--base-checkpoint` (native: `FL2VA/video_vae`, `FL2VA/audio_vae`; modular: `vae/`, `audio_vae/`). When
  that path is a Hugging Face cache snapshot (`.../snapshots/<revision>/`), its revision must be the pinned one.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

from h3serve.checkpoint import native_config
from h3serve.checkpoint.file_reading import CheckpointError, read_json
from h3serve.rules.schedule import PinnedSchedule

INFERENCE_FILE = "fastvideo_inference.json"
PROVENANCE_FILE = "provenance.json"
SCHEMA = "fasth3-inference-contract-v1"
BASE_REPO = "MiniMaxAI/MiniMax-H3"
NAME = "FastH3 8-step V2"
TRAINING_CLOCK = 1000  # DMD rungs are positions on a 1000-step clock
# The contract's keys and the values this checkpoint must carry (`model_id` and `base_model_revision` are allowed
# besides; `schema` may repeat `schema_version`).
CONTRACT: dict[str, object] = {
    "schema_version": SCHEMA,
    "task": "t2av",
    "dmd_denoising_steps": [999, 874, 749, 624, 500, 375, 250, 125],
    "num_inference_steps": 9,
    "transformer_forwards": 8,
    "video_scheduler_shift": 10.0,
    "audio_scheduler_shift": 3.0,
    "guidance_scale": 1.0,
    "attention_backend": "VIDEO_SPARSE_ATTN_H3",
    "vsa_sparsity": 0.8,
    "vsa_tile_size": 64,
}
OPTIONAL_KEYS = ("schema", "model_id", "base_model_revision")
_SNAPSHOT = re.compile(r"models--(?P<org>[^/]+?)--(?P<name>[^/]+)/snapshots/(?P<rev>[0-9a-f]{7,64})(?:/|$)")


def is_fasth3_v2(root: Path) -> bool:
    """Whether `root` holds a FastVideo inference contract (then it must be a valid V2 tree)."""
    return (root / INFERENCE_FILE).is_file()


@dataclass(frozen=True)
class FastH3Contract:
    """What a checked `fastvideo_inference.json` fixes: the pinned schedule and the VSA settings."""

    positions: tuple[float, ...]  # sigma positions before the shift, ending at 0
    video_shift: float
    audio_shift: float
    sparsity: float
    tile_size: int
    base_revision: str  # the pinned base snapshot's revision

    def pin(self) -> PinnedSchedule:
        return PinnedSchedule(owner=f"the {NAME} checkpoint", positions=self.positions,
                              flow_shift=self.video_shift, audio_flow_shift=self.audio_shift)


def _same(value: object, want: object) -> bool:
    """Equal as JSON values, an int never a bool (1 == True in Python)."""
    if isinstance(want, list):
        return isinstance(value, list) and len(value) == len(want) and all(map(_same, value, want))
    if isinstance(value, bool) or isinstance(want, bool):
        return value is want
    if isinstance(want, int | float):
        return isinstance(value, int | float) and math.isfinite(value) and value == want
    return value == want


def read_contract(root: Path) -> FastH3Contract:
    """`fastvideo_inference.json` and `provenance.json` checked key by key; `CheckpointError` naming the key."""
    where = root / INFERENCE_FILE
    data = read_json(where)
    if not isinstance(data, dict):
        raise CheckpointError(f"{where}: must hold a JSON object")
    unknown = sorted(set(data) - set(CONTRACT) - set(OPTIONAL_KEYS))
    missing = sorted(set(CONTRACT) - set(data))
    if unknown or missing:
        raise CheckpointError(f"{where}: the {SCHEMA} keys are {', '.join(CONTRACT)}; missing {missing or 'none'}, "
                              f"unknown {unknown or 'none'}")
    for key, want in CONTRACT.items():
        if not _same(data[key], want):
            raise CheckpointError(f"{where}: {key} is {data[key]!r}; the {NAME} contract requires {want!r}")
    if "schema" in data and data["schema"] != SCHEMA:
        raise CheckpointError(f"{where}: schema is {data['schema']!r}; expected {SCHEMA!r}")
    for name, key in (("scheduler", "video_scheduler_shift"), ("audio_scheduler", "audio_scheduler_shift")):
        config = root / name / "scheduler_config.json"
        if config.is_file() and not _same(read_json(config).get("shift"), data[key]):
            raise CheckpointError(f"{config}: shift {read_json(config).get('shift')!r} disagrees with "
                                  f"{INFERENCE_FILE} {key} {data[key]!r}")
    steps = [int(s) for s in CONTRACT["dmd_denoising_steps"]]  # type: ignore[attr-defined]
    return FastH3Contract(
        positions=(*(s / TRAINING_CLOCK for s in steps), 0.0),
        video_shift=float(data["video_scheduler_shift"]),
        audio_shift=float(data["audio_scheduler_shift"]),
        sparsity=float(data["vsa_sparsity"]),
        tile_size=int(data["vsa_tile_size"]),
        base_revision=_base_revision(root, data),
    )


def _base_revision(root: Path, contract: dict) -> str:
    """The pinned base revision: provenance.json's `base_model_revision` (or the contract's), `hf://<repo>@<rev>`."""
    provenance = root / PROVENANCE_FILE
    source = read_json(provenance) if provenance.is_file() else {}
    value = source.get("base_model_revision", contract.get("base_model_revision"))
    if value is None:
        raise CheckpointError(f"{root}: no {PROVENANCE_FILE} naming base_model_revision (hf://{BASE_REPO}@<revision>):"
                              " the VAEs must come from the snapshot the checkpoint was distilled against")
    if not isinstance(value, str) or not value.startswith("hf://"):
        raise CheckpointError(f"{provenance}: base_model_revision {value!r} is not hf://<repo>@<revision>")
    repo, at, revision = value[len("hf://"):].partition("@")
    if repo != BASE_REPO or not at or not revision.strip():
        raise CheckpointError(f"{provenance}: base_model_revision {value!r}; expected hf://{BASE_REPO}@<revision>")
    return revision


@dataclass(frozen=True)
class BaseVaes:
    """The base checkpoint's video and audio VAE folders and their formats (native | diffusers)."""

    components: dict[str, Path]
    formats: dict[str, str]
    note: str  # how the revision was checked, for the start-up log


def base_vaes(base: Path | None, revision: str) -> BaseVaes:
    """The VAEs of the local base checkpoint `base`: native `FL2VA/{video,audio}_vae` (or a variant folder's own),
    else modular `vae/` and `audio_vae/`. `CheckpointError` when absent, incomplete or of another revision."""
    if base is None:
        raise CheckpointError(f"the {NAME} checkpoint decodes with the VAEs of hf://{BASE_REPO}@{revision} "
                              f"(FL2VA/video_vae, FL2VA/audio_vae); name a local copy with --base-checkpoint PATH "
                              "(h3serve downloads nothing)")
    base = base.expanduser().resolve()
    if not base.is_dir():
        raise CheckpointError(f"--base-checkpoint {base}: not a directory")
    snapshot = _SNAPSHOT.search(base.as_posix() + "/")
    if snapshot is not None:
        repo = f"{snapshot['org']}/{snapshot['name']}"
        if repo != BASE_REPO or not (snapshot["rev"].startswith(revision) or revision.startswith(snapshot["rev"])):
            raise CheckpointError(f"--base-checkpoint {base}: a snapshot of {repo}@{snapshot['rev']}; the {NAME} "
                                  f"checkpoint pins {BASE_REPO}@{revision}")
        note = f"revision {snapshot['rev']} matches the pinned one"
    else:
        note = f"not a Hugging Face cache snapshot: its revision cannot be checked against the pinned {revision}"
    candidates = {"vae": ("FL2VA/video_vae", "video_vae", "vae"), "audio_vae": ("FL2VA/audio_vae", "audio_vae")}
    components, formats, gaps = {}, {}, []
    for name, places in candidates.items():
        found = next((base / p for p in places if (base / p).is_dir()), None)
        if found is None:
            gaps.append(f"{name}: none of {', '.join(places)}")
            continue
        native = (native_config.is_native_video_vae(found) if name == "vae"
                  else native_config.is_native_audio_vae(found))
        try:
            if name == "vae" and native:
                native_config.video_vae_weights(found)
            elif native:
                native_config.audio_vae_weights(found)
            elif not any(found.glob("*.safetensors")):
                raise CheckpointError(f"{found}: no weights")
        except CheckpointError as e:
            gaps.append(str(e))
            continue
        components[name], formats[name] = found, "native" if native else "diffusers"
    if gaps:
        raise CheckpointError(f"--base-checkpoint {base}: " + "; ".join(gaps))
    return BaseVaes(components, formats, note)


def describe(contract: FastH3Contract) -> str:
    """One line for the start-up log and the model card."""
    return (f"{NAME}: {len(contract.positions) - 1} forwards on positions {list(contract.positions)}, shifts "
            f"{contract.video_shift:g}/{contract.audio_shift:g}, VSA sparsity {contract.sparsity:g} in "
            f"{contract.tile_size}-row tiles, T2VA only, VAEs of {BASE_REPO}@{contract.base_revision}")


def contract_json() -> str:
    """The contract as the tiny builder writes it (sorted keys)."""
    return json.dumps(CONTRACT, indent=2, sort_keys=True) + "\n"
