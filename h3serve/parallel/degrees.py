"""Parallel degrees: validation against the model's shapes, and where each rank sits. Pure, no torch.distributed.

Rank layout (innermost first): tensor parallel, then Ulysses, then Ring, then replicas. TP peers are adjacent
ranks (the fastest links on one node); inside one sequence-parallel group, ascending global rank is ascending
sequence-chunk index `ring · U + ulysses`, so an all-gather over that group (whose rank order is the sorted
global order) concatenates the chunks in sequence order.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path

from h3serve.checkpoint.resolver import CheckpointError, read_layout
from h3serve.config.engine_config import EngineConfig
from h3serve.errors import ConfigError
from h3serve.model.transformer_config import H3TransformerConfig

VAE_PARALLEL_MODES = ("tile",)


@dataclass(frozen=True)
class ModelDims:
    """The sizes the degrees must divide (read from the checkpoint's config files)."""

    dit_heads: int
    dit_ffn: int
    dit_hidden: int
    text_heads: int
    text_kv_heads: int
    dit_layers: int = 0  # blocks of the main DiT (the one resident layers apply to)


def _json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"--model: cannot read {path} ({e})") from None


def read_model_dims(model: Path, dits: tuple[str, ...] = ("transformer", "transformer_ref")) -> ModelDims:
    """DiT and text-encoder sizes from `<model>/<component>/config.json`. With several DiTs (FL2VA and Ref2VA,
    the same shapes in the released model) a degree must suit all of them, hence the gcds."""
    try:
        layout = read_layout(model, dits)
        names = [name for name in dits if layout.has(name) and (layout.component(name) / "config.json").exists()]
        if not names:
            raise ConfigError(f"--model: {model} has none of the DiTs {', '.join(dits)}")
        configs = [H3TransformerConfig.from_dict(layout.component_config(name)) for name in names]
        text = _json(layout.component("text_encoder") / "config.json")
    except CheckpointError as e:
        raise ConfigError(f"--model: {e}") from None
    text = text.get("text_config", text)
    heads = int(text["num_attention_heads"])
    return ModelDims(
        dit_heads=math.gcd(*(c.num_attention_heads for c in configs)),
        dit_ffn=math.gcd(*(c.ffn_dim for c in configs)),
        dit_hidden=math.gcd(*(c.hidden_size for c in configs)),
        text_heads=heads,
        text_kv_heads=int(text.get("num_key_value_heads", heads)),
        dit_layers=configs[0].num_layers,
    )


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _choices(n: int) -> str:
    return ", ".join(map(str, divisors(n)))


@dataclass(frozen=True)
class RankCoords:
    replica: int
    tp: int
    ulysses: int
    ring: int


@dataclass(frozen=True)
class ParallelDegrees:
    """How the ranks split the work. `world_size` is a multiple of tp·ulysses·ring (extra ranks are replicas)."""

    tensor_parallel: int = 1
    ulysses: int = 1
    ring: int = 1
    text_encoder_tp: int = 1
    vae_patch_parallel: int = 1
    world_size: int = 1

    @classmethod
    def of(cls, config: EngineConfig) -> ParallelDegrees:
        """The degrees an engine's flags name."""
        return cls(
            tensor_parallel=config.tensor_parallel_size,
            ulysses=config.ulysses_degree,
            ring=config.ring_degree,
            text_encoder_tp=config.text_encoder_tp_size,
            vae_patch_parallel=config.vae_patch_parallel_size,
            world_size=config.world_size,
        )

    @property
    def sequence_parallel(self) -> int:
        return self.ulysses * self.ring

    @property
    def dit_group(self) -> int:
        """Ranks that cooperate on one DiT forward."""
        return self.tensor_parallel * self.sequence_parallel

    @property
    def replicas(self) -> int:
        return self.world_size // self.dit_group

    def coords(self, rank: int) -> RankCoords:
        t, u = self.tensor_parallel, self.ulysses
        inner = rank % self.dit_group
        return RankCoords(replica=rank // self.dit_group, tp=inner % t, ulysses=(inner // t) % u, ring=inner // (t * u))

    def rank_of(self, c: RankCoords) -> int:
        t, u = self.tensor_parallel, self.ulysses
        return c.replica * self.dit_group + (c.ring * u + c.ulysses) * t + c.tp

    def communicators(self, rank: int) -> tuple[str, ...]:
        """The process groups of more than one rank that `rank` joins, as `h3serve.parallel.setup` creates them
        (on CUDA each is one NCCL communicator): the world, each of the tp / ulysses / ring axes whose degree is
        above 1, the sequence-parallel group (Ulysses x Ring) when both axes are (with one axis, that axis' group is
        the sequence group), and the text-encoder TP group (its first N ranks). VAE tile parallelism uses the world
        group."""
        names = ["world"] if self.world_size > 1 else []
        names += [
            axis for axis, n in (("tp", self.tensor_parallel), ("ulysses", self.ulysses), ("ring", self.ring)) if n > 1
        ]
        if self.ulysses > 1 and self.ring > 1:
            names.append("sp")
        if self.text_encoder_tp > 1 and rank < self.text_encoder_tp:
            names.append("text_encoder")
        return tuple(names)

    def group_ranks(self, rank: int, axes: tuple[str, ...]) -> list[int]:
        """The ranks that share every coordinate of `rank` except those in `axes` (sorted ascending)."""
        me = self.coords(rank)
        sizes = {"tp": self.tensor_parallel, "ulysses": self.ulysses, "ring": self.ring}
        members = [me]
        for axis in axes:
            members = [replace(m, **{axis: i}) for m in members for i in range(sizes[axis])]
        return sorted(self.rank_of(m) for m in members)


def check_degrees(
    d: ParallelDegrees, dims: ModelDims, cfg_parallel_size: int = 1, vae_parallel_mode: str = "tile"
) -> None:
    """Raise `ConfigError`, naming the fix, on an impossible layout."""
    for flag, value in (
        ("--tensor-parallel-size", d.tensor_parallel),
        ("--usp/--ulysses-degree", d.ulysses),
        ("--ring/--ring-degree", d.ring),
        ("--text-encoder-tp-size", d.text_encoder_tp),
        ("--vae-patch-parallel-size", d.vae_patch_parallel),
        ("--num-gpus", d.world_size),
    ):
        if value < 1:
            raise ConfigError(f"{flag} must be >= 1, got {value}")
    if cfg_parallel_size != 1:
        raise ConfigError(
            f"--cfg-parallel-size {cfg_parallel_size}: MiniMax-H3 is CFG-distilled and has no negative branch; "
            "cfg_parallel_size must be 1"
        )
    tp = d.tensor_parallel
    tp_ok = math.gcd(dims.dit_heads, dims.dit_ffn, 18 * dims.dit_hidden)
    if dims.dit_heads % tp:
        raise ConfigError(
            f"--tensor-parallel-size {tp}: num_attention_heads must be divisible by tensor_parallel_size "
            f"({dims.dit_heads} % {tp} != 0); choose from: {_choices(tp_ok)}"
        )
    if dims.dit_ffn % tp or (18 * dims.dit_hidden) % tp:
        raise ConfigError(
            f"--tensor-parallel-size {tp}: the FFN width ({dims.dit_ffn}) and AdaLN width (18·{dims.dit_hidden}) "
            f"must be divisible by tensor_parallel_size; choose from: {_choices(tp_ok)}"
        )
    local_heads = dims.dit_heads // tp
    if local_heads % d.ulysses:
        raise ConfigError(
            f"--usp {d.ulysses}: local attention heads must be divisible by ulysses_degree "
            f"(({dims.dit_heads} / tp {tp}) % {d.ulysses} != 0); choose from: {_choices(local_heads)}"
        )
    if d.world_size % d.dit_group:
        raise ConfigError(
            f"--num-gpus {d.world_size} must be a multiple of tensor_parallel_size·ulysses·ring = {d.dit_group}; "
            f"use --num-gpus {d.dit_group}"
        )
    te = d.text_encoder_tp
    te_ok = math.gcd(dims.text_heads, dims.text_kv_heads)
    if te > d.world_size:
        raise ConfigError(f"--text-encoder-tp-size {te} must not exceed the group size ({d.world_size} ranks)")
    if te_ok % te:
        raise ConfigError(
            f"--text-encoder-tp-size {te} must divide both the text encoder's num_attention_heads "
            f"({dims.text_heads}) and num_key_value_heads ({dims.text_kv_heads}); "
            f"choose from: {', '.join(str(n) for n in divisors(te_ok) if n <= d.world_size)}"
        )
    if vae_parallel_mode not in VAE_PARALLEL_MODES:
        raise ConfigError(
            f"--vae-parallel-mode {vae_parallel_mode}: MiniMax-H3's VAE supports its tile parallel mode only; "
            f"choose from: {', '.join(VAE_PARALLEL_MODES)}"
        )
    if d.vae_patch_parallel not in (1, d.world_size):
        raise ConfigError(
            f"--vae-patch-parallel-size {d.vae_patch_parallel}: VAE tile parallelism uses one rank or the whole "
            f"group; choose from: 1, {d.world_size}"
        )


def parallel_notices(d: ParallelDegrees) -> list[str]:
    """Layouts that are legal but may surprise: said once, in one line each."""
    if d.replicas > 1:
        return [
            f"notice: --num-gpus {d.world_size} is {d.replicas}x tensor_parallel_size·ulysses·ring ({d.dit_group}): "
            f"the DiT runs as {d.replicas} identical replicas (one request at a time, no data parallelism); "
            "the extra ranks serve text-encoder TP and VAE tiles"
        ]
    return []
