"""OffloadConfig: which components are staged (module offload) or streamed block by block (layerwise, DLO).

Built once from the vLLM-Omni flags (`--enable-cpu-offload`, `--enable-layerwise-offload`,
`--enable-distributed-layerwise-offload`, `--dlo-*`) or their compact JSON form (`--diffusion-offload-config`).
Pure, no torch. Checks that need the model's block count live in `check_resident_layers`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Literal

from h3serve.errors import ServerError

# Components a user names ("dit" covers both DiTs), and the checkpoint components each one stands for.
USER_COMPONENTS: dict[str, tuple[str, ...]] = {
    "dit": ("transformer", "transformer_ref"),
    "text_encoder": ("text_encoder",),
    "vae": ("vae",),
    "audio_vae": ("audio_vae",),
}
STREAMABLE = ("dit", "text_encoder")  # components with repeated blocks that can stream layer by layer
ADALN = "adaln"  # the DiTs' AdaLN projections: kept in host memory, used once per request (h3serve.model.adaln_memo)
MODES = ("module", "layer")
TRANSFERS = ("rank-local", "allgather")
Transfer = Literal["rank-local", "allgather"]
AUTO: Literal["auto"] = "auto"
# The denoise working set in row chunks (h3serve.model.transformer `TransformerBlock.row_chunk`): the planner's
# ladder for `auto`, largest first, and the smallest bound a user may pin (smaller chunks only add launches).
DENOISE_CHUNK_LADDER = (16384, 8192, 4096, 2048, 1024)
MIN_DENOISE_CHUNK_ROWS = 256
DenoiseChunk = int | Literal["auto"] | None


class OffloadError(ServerError, ValueError):
    """An illegal offload flag or combination; the message names the fix (a `ConfigError` at start-up)."""

    code = "invalid_config"


@dataclass(frozen=True)
class OffloadConfig:
    """Where each component's weights live between uses.

    staged:   components kept in (pinned) host memory and moved to the device only for their own stage
              (model-level sequential offload).
    streamed: components whose repeated blocks live in host memory and are copied in one block ahead of use,
              then released (layerwise offload; DLO when `distributed`).
    transfer: how a streamed DiT block reaches the device under DLO: "allgather" (each rank keeps 1/G of every
              block, G the sequence-parallel group, and the block is rebuilt by an all-gather) or "rank-local"
              (each rank copies its own tensor-parallel shard, no collective).
    resident_layers: under rank-local DLO, the first K blocks of the main DiT stay on the device for the whole
              denoise stage (released before the VAE decode); "auto" picks the largest K the planner fits.
    """

    staged: frozenset[str] = field(default_factory=frozenset)
    streamed: frozenset[str] = field(default_factory=frozenset)
    distributed: bool = False
    transfer: Transfer = "rank-local"
    resident_layers: int | Literal["auto"] = 0
    adaln: bool = False  # "adaln" named in the components: AdaLN projections in host memory

    @property
    def enabled(self) -> bool:
        return bool(self.staged or self.streamed or self.adaln)

    def adaln_on_host(self, memo: bool) -> bool:
        """Whether the DiTs' AdaLN projections live in host memory: named (`adaln`), or implied by streaming the
        DiT block by block, where they would otherwise cross PCIe on every step; both need the memoisation
        (without it, the projections stream inside their blocks as before)."""
        return self.adaln or (memo and "dit" in self.streamed)

    def gathers(self, component: str, sequence_parallel: bool) -> bool:
        """Whether `component`'s streamed blocks are all-gathered: DLO all-gather streams it and there is a
        sequence-parallel group to split them over (the text encoder always streams rank-local)."""
        return (
            self.transfer == "allgather"
            and sequence_parallel
            and component != "text_encoder"
            and component in self.streamed_components()
        )

    def staged_components(self) -> frozenset[str]:
        """Checkpoint component names (transformer, transformer_ref, text_encoder, vae, audio_vae)."""
        return frozenset(name for user in self.staged for name in USER_COMPONENTS[user])

    def streamed_components(self) -> frozenset[str]:
        return frozenset(name for user in self.streamed for name in USER_COMPONENTS[user])

    def describe(self) -> str:
        """One line for the start-up log."""
        if not self.enabled:
            return "offload: none (every component resident on the device)"
        parts = []
        if self.staged:
            parts.append(f"staged per stage: {', '.join(sorted(self.staged))}")
        if self.streamed:
            kind = f"DLO {self.transfer}" if self.distributed else "layerwise"
            parts.append(f"streamed per block ({kind}): {', '.join(sorted(self.streamed))}")
        if self.resident_layers:
            parts.append(f"resident DiT blocks: {self.resident_layers}")
        if self.adaln:
            parts.append("AdaLN projections in host memory")
        return "offload: " + "; ".join(parts)


@dataclass(frozen=True)
class OffloadFlags:
    """The raw flags, as argparse gives them (None / False when absent)."""

    enable_cpu_offload: bool = False
    enable_layerwise_offload: bool = False
    enable_distributed_layerwise_offload: bool = False
    dlo_use_allgather: bool | None = None
    dlo_resident_layers: str | None = None  # an integer or "auto"
    diffusion_offload_config: str | None = None  # JSON


def parse_denoise_chunk_rows(text: str | None) -> DenoiseChunk:
    """--denoise-chunk-rows: `auto` (default: the planner chunks only a configuration that would not fit otherwise),
    `off`, or a bound in rows (>= MIN_DENOISE_CHUNK_ROWS); `OffloadError` naming the flag otherwise."""
    value = (text or AUTO).strip().lower()
    if value == AUTO:
        return AUTO
    if value == "off":
        return None
    try:
        rows = int(value)
    except ValueError:
        raise OffloadError(f"--denoise-chunk-rows: expected a number of rows, 'auto' or 'off', got {text!r}") from None
    if rows < MIN_DENOISE_CHUNK_ROWS:
        raise OffloadError(f"--denoise-chunk-rows: must be >= {MIN_DENOISE_CHUNK_ROWS} rows (or 'auto', 'off'), "
                           f"got {rows}")
    return rows


def _resident(value: object, where: str) -> int | Literal["auto"]:
    if value is None:
        return 0
    if value == AUTO:
        return AUTO
    try:
        k = int(str(value))
    except ValueError:
        raise OffloadError(f"{where}: expected a whole number of blocks or 'auto', got {value!r}") from None
    if k < 0:
        raise OffloadError(f"{where}: must be >= 0 (or 'auto'), got {k}")
    return k


def _legacy_flags(f: OffloadFlags) -> list[str]:
    return [
        flag
        for flag, on in (
            ("--enable-cpu-offload", f.enable_cpu_offload),
            ("--enable-layerwise-offload", f.enable_layerwise_offload),
            ("--enable-distributed-layerwise-offload", f.enable_distributed_layerwise_offload),
            ("--dlo-use-allgather/--dlo-no-use-allgather", f.dlo_use_allgather is not None),
            ("--dlo-resident-layers", f.dlo_resident_layers is not None),
        )
        if on
    ]


def _from_compact(text: str) -> OffloadConfig:
    """`{"mode": "module"|"layer", "components": [...], "weight_transfer": ..., "resident_layers": K|"auto",
    "staged": [...]}`.

    Module mode stages every listed component; layer mode streams the DiT and text encoder block by block and
    stages the listed VAEs (they have no repeated blocks) and the components under `staged` (e.g. the text
    encoder staged whole, as the layerwise flags did before they streamed it)."""
    flag = "--diffusion-offload-config"
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise OffloadError(f"{flag}: invalid JSON ({e})") from None
    if not isinstance(value, dict):
        raise OffloadError(f"{flag}: expected a JSON object, got {type(value).__name__}")
    unknown = sorted(set(value) - {"mode", "components", "weight_transfer", "resident_layers", "staged"})
    if unknown:
        raise OffloadError(
            f"{flag}: unknown keys {', '.join(unknown)}; choose from: mode, components, weight_transfer, "
            "resident_layers, staged"
        )
    mode = value.get("mode")
    if mode not in MODES:
        raise OffloadError(f"{flag}: mode must be one of: {', '.join(MODES)}; got {mode!r}")
    components = value.get("components", ["dit"])
    if not isinstance(components, list) or not components or not all(isinstance(c, str) for c in components):
        raise OffloadError(f'{flag}: components must be a non-empty list of names, e.g. ["dit", "text_encoder"]')
    bad = sorted(set(components) - set(USER_COMPONENTS) - {ADALN})
    if bad:
        raise OffloadError(
            f"{flag}: unknown components {', '.join(bad)}; choose from: {', '.join((*USER_COMPONENTS, ADALN))}"
        )
    adaln = ADALN in components
    components = [c for c in components if c != ADALN]
    transfer = value.get("weight_transfer", "rank-local")
    if transfer not in TRANSFERS:
        raise OffloadError(f"{flag}: weight_transfer must be one of: {', '.join(TRANSFERS)}; got {transfer!r}")
    resident = _resident(value.get("resident_layers"), f"{flag} resident_layers")
    whole = value.get("staged", [])
    if not isinstance(whole, list) or not all(isinstance(c, str) for c in whole):
        raise OffloadError(f'{flag}: staged must be a list of component names, e.g. ["text_encoder"]')
    bad = sorted(set(whole) - set(USER_COMPONENTS))
    if bad:
        choices = ", ".join(USER_COMPONENTS)
        raise OffloadError(f"{flag}: unknown staged components {', '.join(bad)}; choose from: {choices}")
    if set(whole) & set(components):
        both = ", ".join(sorted(set(whole) & set(components)))
        raise OffloadError(f"{flag}: {both} listed in both components and staged; name each component once")
    if mode == "module":
        if "weight_transfer" in value or "resident_layers" in value or "staged" in value:
            raise OffloadError(f'{flag}: weight_transfer, resident_layers and staged apply to mode "layer" only')
        return OffloadConfig(staged=frozenset(components), adaln=adaln)
    if transfer == "allgather" and "text_encoder" in components:
        raise OffloadError(
            f"{flag}: the text encoder cannot use weight_transfer allgather (its weights are not replicated "
            'over the sequence-parallel group); use "weight_transfer": "rank-local"'
        )
    # Layer mode streams the components that have repeated blocks; the others (the VAEs) are staged.
    config = OffloadConfig(
        staged=frozenset(c for c in components if c not in STREAMABLE) | frozenset(whole),
        streamed=frozenset(c for c in components if c in STREAMABLE),
        distributed=transfer == "allgather" or resident != 0,
        transfer=transfer,
        resident_layers=resident,
        adaln=adaln,
    )
    _check_resident_transfer(config, f"{flag} resident_layers", f'{flag} "weight_transfer": "rank-local"')
    return config


def _check_resident_transfer(config: OffloadConfig, flag: str, fix: str) -> None:
    if config.resident_layers and config.transfer == "allgather":
        raise OffloadError(
            f"{flag}: resident layers require the DiT DLO transfer to be rank-local (each rank keeps its own "
            f"shard of the resident blocks); set {fix}"
        )


def offload_config_from_flags(f: OffloadFlags) -> OffloadConfig:
    """The OffloadConfig for the flags; `OffloadError` (with the fix) for an illegal combination."""
    legacy = _legacy_flags(f)
    if f.diffusion_offload_config is not None:
        if legacy:
            raise OffloadError(
                f"--diffusion-offload-config cannot be combined with legacy offload option(s): {', '.join(legacy)}; "
                "give the compact JSON alone (e.g. "
                '\'{"mode": "layer", "components": ["dit"], "weight_transfer": "rank-local", "resident_layers": 20}\')'
            )
        return _from_compact(f.diffusion_offload_config)
    modes = [flag for flag in legacy if flag.startswith("--enable-")]
    if len(modes) > 1:
        raise OffloadError(f"{' and '.join(modes)} are alternatives; choose one offload mode")
    dlo_options = f.dlo_use_allgather is not None or f.dlo_resident_layers is not None
    if dlo_options and not f.enable_distributed_layerwise_offload:
        raise OffloadError(
            "--dlo-use-allgather/--dlo-no-use-allgather/--dlo-resident-layers are options of distributed "
            "layerwise offload; add --enable-distributed-layerwise-offload"
        )
    if f.enable_cpu_offload:
        return OffloadConfig(staged=frozenset(USER_COMPONENTS))
    # The layerwise flags stream the text encoder block by block beside the DiT, as vLLM-Omni's H3 pipeline does
    # (always rank-local: its weights are not replicated over the sequence-parallel group), and keep the VAEs
    # in host memory, staged on demand. Staging the encoder whole: --diffusion-offload-config's "staged".
    staged, streamed = frozenset({"vae", "audio_vae"}), frozenset({"dit", "text_encoder"})
    if f.enable_layerwise_offload:
        return OffloadConfig(staged=staged, streamed=streamed)
    if f.enable_distributed_layerwise_offload:
        use_allgather = True if f.dlo_use_allgather is None else f.dlo_use_allgather
        config = OffloadConfig(
            staged=staged,
            streamed=streamed,
            distributed=True,
            transfer="allgather" if use_allgather else "rank-local",
            resident_layers=_resident(f.dlo_resident_layers, "--dlo-resident-layers"),
        )
        _check_resident_transfer(config, "--dlo-resident-layers", "--dlo-no-use-allgather")
        return config
    return OffloadConfig()


def check_resident_layers(resident: int, num_layers: int) -> None:
    """K resident blocks of N must leave 0 or at least 2 streamed blocks (double buffering needs two slots)."""
    if resident > num_layers:
        raise OffloadError(
            f"--dlo-resident-layers {resident}: the DiT has only {num_layers} blocks; use 0..{num_layers}"
        )
    if num_layers - resident == 1:
        raise OffloadError(
            f"--dlo-resident-layers {resident} leaves only one streaming block of {num_layers}; use at most "
            f"{num_layers - 2}, or {num_layers} to keep every block resident"
        )


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "k": 2**10, "m": 2**20, "g": 2**30}
_UNITS |= {"t": 2**40, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}  # a bare G is GiB, as nvidia-smi


def parse_bytes(text: str, flag: str = "--device-memory") -> int:
    """'32GiB', '24 GB', '80G', '1000000' (bytes) -> bytes; `OffloadError` naming `flag` otherwise."""
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise OffloadError(f"{flag}: expected a size such as 32GiB, 24GB or 80G, got {text!r}")
    value = int(float(match.group(1)) * _UNITS[unit])
    if value <= 0:
        raise OffloadError(f"{flag}: must be positive, got {text!r}")
    return value
