"""The adapter a request runs with, once resolved (`AdapterChoice`), and what a Turbo file's name promises
(`TurboContract`) or a PDD file holds (`PddContract`): value types the request, the plan, the job store and the
rank share. Reading and checking the files is `h3serve.adapters`'."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from h3serve.errors import RequestError
from h3serve.rules.schedule import PinnedSchedule

FASTH3_TASKS = ("t2va",)  # what a server with a fused FastH3 adapter serves
TURBO_FAMILY_TASKS = {"fl2v": ("t2va", "fl2va"), "ref2v": ("ref2va",)}  # a Turbo file's family -> what it serves
PDD_VARIANT_TASKS = {"fl2va": ("t2va", "fl2va"), "ref2va": ("ref2va",)}  # a PDD file's variant -> what it serves


@dataclass(frozen=True)
class TurboContract:
    """What a Turbo file's name promises: the tasks it serves, its forward count and its shifts."""

    file_name: str
    family: str  # fl2v | ref2v
    forwards: int
    version: str
    flow_shift: float
    audio_flow_shift: float = 3.0

    @property
    def tasks(self) -> tuple[str, ...]:
        return TURBO_FAMILY_TASKS[self.family]


@dataclass(frozen=True)
class PddContract:
    """What a PDD 8-step file holds: its variant (the DiT it was distilled for), its pinned schedule (`forwards`
    forwards with shifts 12 / 3) and its head bank (`bank_steps` heads, fused `block` at a time)."""

    file_name: str
    variant: str  # fl2va | ref2va
    key_format: str
    forwards: int
    block: int
    bank_steps: int
    flow_shift: float
    audio_flow_shift: float

    @property
    def tasks(self) -> tuple[str, ...]:
        return PDD_VARIANT_TASKS[self.variant]


@dataclass(frozen=True)
class FlashGenContract:
    """What a FlashGen 4-step LoRA's metadata promises: its base schedule (sigma positions before the shift, 4
    intervals), the tasks it serves (the FL2VA DiT's), its rank and alpha."""

    file_name: str
    positions: tuple[float, ...]
    tasks: tuple[str, ...]
    rank: int
    alpha: float

    @property
    def forwards(self) -> int:
        return len(self.positions) - 1


@dataclass(frozen=True)
class AdapterChoice:
    """A resolved adapter for one request: the file to read, the request scale, what the file promises."""

    name: str
    path: str  # the .safetensors file
    scale: float  # the request's scale; the layers use scale · alpha / rank
    int_id: int
    rank: int
    alpha: float
    turbo: TurboContract | None = None
    pdd: PddContract | None = None
    flashgen: FlashGenContract | None = None

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> AdapterChoice:
        """The inverse of `dataclasses.asdict` (the job store keeps a queued request as JSON)."""
        turbo, pdd, flashgen = data.get("turbo"), data.get("pdd"), data.get("flashgen")
        if flashgen is not None:
            flashgen = FlashGenContract(**{**flashgen, "positions": tuple(flashgen["positions"]),
                                           "tasks": tuple(flashgen["tasks"])})
        return cls(**{**data, "turbo": None if turbo is None else TurboContract(**turbo),
                      "pdd": None if pdd is None else PddContract(**pdd), "flashgen": flashgen})


def turbo_pin(contract: TurboContract, adapter: str, task: str) -> PinnedSchedule:
    """The schedule a request naming a Turbo adapter runs: the contract's forward count and shifts (a request may
    omit or restate them; rules.schedule refuses others). `RequestError` on a task the artifact does not serve."""
    if task not in contract.tasks:
        raise RequestError("lora", f"{adapter} ({contract.file_name}) serves {', '.join(contract.tasks)}, not {task}")
    return PinnedSchedule(
        owner=f"the {contract.forwards}-step Turbo adapter {adapter} ({contract.file_name})",
        steps=contract.forwards,
        flow_shift=contract.flow_shift,
        audio_flow_shift=contract.audio_flow_shift,
    )


def flashgen_pin(contract: FlashGenContract, adapter: str, task: str) -> PinnedSchedule:
    """The schedule a request naming a FlashGen LoRA runs: its metadata's base schedule (4 forwards; the request
    may omit `num_inference_steps` or send 4). `RequestError` on a task it does not serve."""
    owner = f"the {contract.forwards}-step FlashGen LoRA {adapter} ({contract.file_name})"
    if task not in contract.tasks:
        raise RequestError("lora", f"{owner} serves {', '.join(contract.tasks)}, not {task}")
    return PinnedSchedule(owner=owner, positions=contract.positions)


def pdd_pin(contract: PddContract, adapter: str, task: str, scale: float) -> PinnedSchedule:
    """The schedule a request naming a PDD adapter runs: its forwards on the uniform grid with shifts 12 / 3 (its
    head bank was distilled for exactly that). `RequestError` on a task of the other variant, or a scale other than
    1 (the heads are not scaled: a scaled trunk would not match them)."""
    owner = f"the {contract.forwards}-step PDD adapter {adapter} ({contract.file_name})"
    if task not in contract.tasks:
        raise RequestError("lora", f"{owner} serves {', '.join(contract.tasks)}, not {task}")
    if scale != 1.0:
        raise RequestError("lora.scale", f"{owner} runs at scale 1 only (its heads are not scaled), got {scale:g}")
    return PinnedSchedule(owner=owner, steps=contract.forwards, flow_shift=contract.flow_shift,
                          audio_flow_shift=contract.audio_flow_shift)


def merged_choice(merged: AdapterChoice, asked: AdapterChoice | None, task: str) -> AdapterChoice:
    """The adapter a request runs on a server that merged `merged` into its DiTs' weights (`--merge-lora`): that
    one, whether the request names it (by name or path, at its scale) or no adapter. Any other adapter or scale is
    refused with the reason rather than served: the base weights are gone, so another adapter would run on top of
    this one. A task the adapter's contract does not serve is refused too."""
    owner = f"this server merged the adapter {merged.name} into its weights at load (--merge-lora)"
    if asked is not None and asked.path != merged.path:
        raise RequestError("lora", f"{owner} and serves that adapter only, not {asked.name}; a server without "
                                   "--merge-lora switches adapters per request")
    if asked is not None and asked.scale != merged.scale:
        raise RequestError("lora.scale", f"{owner} at scale {merged.scale:g}; it cannot run scale {asked.scale:g}")
    contract = merged.turbo or merged.pdd
    if contract is not None and task not in contract.tasks:
        raise RequestError("task", f"{owner}, which serves {', '.join(contract.tasks)} only, not {task}")
    return merged
