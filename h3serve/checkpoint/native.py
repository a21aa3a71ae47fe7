"""The native MiniMaxAI checkpoint trees: a root holding `FL2VA/` and/or `Ref2VA/`, or one variant folder. Torch-free.

`hf download MiniMaxAI/MiniMax-H3` yields one folder per DiT variant, each with a `model_index.json` whose
`_minimax_h3` block names its `partition` (fl2va serves t2va + fl2va, ref2va serves ref2va), its `tasks` and the
`sigma_shift_scales` of the two schedulers. The shared components (text encoder, tokenizer, processor, both VAEs)
live in each variant folder or only in one of them (vLLM-Omni fetches `Ref2VA/transformer/**` and
`Ref2VA/model_index.json` only); each is read once, from the first folder that has it: FL2VA, Ref2VA, the root.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from h3serve.checkpoint import native_config
from h3serve.checkpoint.file_reading import CheckpointError, missing_weights, read_json

VARIANTS = {"transformer": "FL2VA", "transformer_ref": "Ref2VA"}  # our DiT component -> variant folder
PARTITIONS = {"transformer": "fl2va", "transformer_ref": "ref2va"}
_DIT_OF_PARTITION = {p: d for d, p in PARTITIONS.items()}
DEFAULT_SHIFTS = {"video": 12.0, "audio": 3.0}  # vLLM-Omni's defaults when the block has none
_CANVAS_KEYS = ("canvas_short_edge", "canvas_max_pixels", "reference_image_short_edge")  # h3serve: tiny sizes
# our component name -> the folder names that may hold it, native first
SHARED = {
    "vae": ("video_vae", "vae"),
    "audio_vae": ("audio_vae",),
    "text_encoder": ("text_encoder",),
    "tokenizer": ("tokenizer",),
    "processor": ("processor",),
}


@dataclass(frozen=True)
class NativeTree:
    """What a native tree serves: component folders, their formats, scheduler shifts and canvas config."""

    root: Path
    components: dict[str, Path]
    formats: dict[str, str]
    shifts: dict[str, float]
    pipeline_config: dict = field(default_factory=dict)


def release_block(folder: Path) -> dict | None:
    """The `_minimax_h3` block of `<folder>/model_index.json`, or None when the folder is no native variant."""
    path = folder / "model_index.json"
    if not path.is_file():
        return None
    block = read_json(path).get("_minimax_h3")
    return block if isinstance(block, dict) else None


def variant_folders(root: Path) -> dict[str, Path]:
    """DiT component -> variant folder: the root's FL2VA/ and Ref2VA/, or the root itself when it is one variant."""
    block = release_block(root)
    if block is not None:
        partition = str(block.get("partition", "")).lower()
        if partition not in _DIT_OF_PARTITION:
            raise CheckpointError(
                f"{root}/model_index.json: _minimax_h3.partition is {partition!r}; expected fl2va or ref2va"
            )
        return {_DIT_OF_PARTITION[partition]: root}
    return {dit: root / name for dit, name in VARIANTS.items() if (root / name).is_dir()}


def _check_partition(dit: str, folder: Path) -> dict:
    block = release_block(folder)
    if block is None:
        raise CheckpointError(f"{folder}: no model_index.json with a _minimax_h3 block (not downloaded yet?)")
    partition = str(block.get("partition", "")).lower()
    if partition != PARTITIONS[dit]:
        raise CheckpointError(
            f"{folder}/model_index.json: _minimax_h3.partition is {partition!r}, expected {PARTITIONS[dit]!r} "
            f"for the {VARIANTS[dit]} variant"
        )
    return block


def _problems(name: str, folder: Path, label: str) -> list[str]:
    """What is missing for one component folder, as readable lines (empty when it is complete)."""
    if not folder.is_dir():
        return [f"{label}: folder missing"]
    if name in ("transformer", "transformer_ref", "text_encoder"):
        config = [] if (folder / "config.json").is_file() else [f"{label}/config.json: missing"]
        weights = missing_weights(folder, label)
        return config + ([weights] if weights else [])
    try:
        if name == "vae" and native_config.is_native_video_vae(folder):
            native_config.video_vae_weights(folder)
        elif name == "audio_vae" and native_config.is_native_audio_vae(folder):
            native_config.audio_vae_weights(folder)
            native_config.audio_vae_config(folder)
        elif name in ("vae", "audio_vae"):
            weights = missing_weights(folder, label)
            return [weights] if weights else []
    except CheckpointError as e:
        return [str(e)]
    return []


def _shifts(blocks: dict[str, dict]) -> dict[str, float]:
    values = {
        dit: {k: float((b.get("sigma_shift_scales") or {}).get(k, v)) for k, v in DEFAULT_SHIFTS.items()}
        for dit, b in blocks.items()
    }
    first = next(iter(values.values()))
    for shifts in values.values():
        if shifts != first:
            raise CheckpointError(
                f"the FL2VA and Ref2VA variants declare different sigma_shift_scales ({values['transformer']} vs "
                f"{values['transformer_ref']}); h3serve serves one schedule: serve them with --task-type"
            )
    return {"scheduler": first["video"], "audio_scheduler": first["audio"]}


def read_native(root: Path, dits: tuple[str, ...]) -> NativeTree:
    """The components of a native tree for the wanted DiTs; anything missing is refused with every gap named."""
    variants = variant_folders(root)
    served = {dit: folder for dit, folder in variants.items() if dit in dits}
    if not served:
        found = ", ".join(f.name for f in variants.values()) or "no variant folder"
        wanted = " or ".join(VARIANTS[d] for d in dits)
        raise CheckpointError(f"{root}: the requested task type needs the {wanted} variant; this tree has {found}")
    blocks = {dit: _check_partition(dit, folder) for dit, folder in served.items()}
    components: dict[str, Path] = {}
    problems: list[str] = []
    for dit, folder in served.items():
        components[dit] = folder / "transformer"
        problems += _problems(dit, folder / "transformer", f"{folder.name}/transformer")
    search = [*served.values(), *(f for f in variants.values() if f not in served.values()), root]
    for name, folder_names in SHARED.items():
        found = next((f / n for f in search for n in folder_names if (f / n).is_dir()), None)
        if found is None:
            places = ", ".join(dict.fromkeys(f"{f.name}/{folder_names[0]}" for f in search))
            problems.append(f"{name}: not found (looked in {places})")
            continue
        components[name] = found
        problems += _problems(name, found, f"{found.parent.name}/{found.name}")
    if problems:
        raise CheckpointError(f"{root}: incomplete MiniMax-H3 checkpoint: " + "; ".join(problems))
    formats = {
        "vae": "native" if native_config.is_native_video_vae(components["vae"]) else "diffusers",
        "audio_vae": "native" if native_config.is_native_audio_vae(components["audio_vae"]) else "diffusers",
    }
    primary = blocks.get("transformer") or blocks["transformer_ref"]
    canvas = {k: primary[k] for k in _CANVAS_KEYS if k in primary}
    return NativeTree(root, components, formats, _shifts(blocks), canvas)
