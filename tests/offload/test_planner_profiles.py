"""The planner against every published measured profile of H3 (the model card and vLLM-Omni's H3 recipes;
`docs/memory.md`, "Against every measured profile").

`--preset released` on the meta device, planned as vLLM-Omni ran each profile: its conventions
(`h3serve.offload.measured_engine`: fp32 video VAE, whole-video decode, its encoder layout and communicators, the
denoise cache it kept through the decode), the AdaLN projections inside their blocks (memo off), compiled where the
recipe compiles, the same offload. nvidia-smi samples are compared with the plan's total (tensors + runtime
overhead), the allocator's reserved peaks (`x-peak-memory-mb`, rank 0) with its tensors + the terms inside the
allocator's pool. Each planned figure is pinned (a planner change moves these numbers on purpose, and
docs/memory.md with them); every measurement is within -5% ... +15% of its plan but one, whose request inputs the
recipe does not state (`OUTSIDE_THE_BAND`).
"""

from __future__ import annotations

from typing import NamedTuple

import pytest

from h3serve.config.offload_config import OffloadConfig
from h3serve.offload.activations import RequestShape
from h3serve.offload.inventory import RELEASED, build_inventory
from h3serve.offload.measured_engine import H3SERVE, UNMODELLED, UNMODELLED_PROFILES, VLLM_OMNI
from h3serve.offload.overhead import RESERVED_TERMS
from h3serve.offload.placement_plan import GiB, PlacementPlan
from h3serve.offload.planner import Runtime, plan_placement
from h3serve.parallel.degrees import ParallelDegrees

MiB = 2**20
CANVAS = RequestShape(1344, 768, 124, "fl2va")  # two keyframes at the canvas size (the CLI's FL2VA shape)
FIRST_FRAME = RequestShape(1344, 768, 124, "fl2va", condition_images=1)  # the recipes' first-frame FL2VA
SMALL_T2VA = RequestShape(1024, 576, 124, "t2va", steps=60)
# One reference image at the canvas size; the recipe's reference image and audio are not stated.
SMALL_REF2VA = RequestShape(1024, 576, 124, "ref2va", steps=60)


def dlo(resident: int) -> OffloadConfig:
    """The recipes' --enable-distributed-layerwise-offload --dlo-no-use-allgather: DiT and encoder streamed."""
    return OffloadConfig(
        staged=frozenset({"vae", "audio_vae"}),
        streamed=frozenset({"dit", "text_encoder"}),
        distributed=True,
        transfer="rank-local",
        resident_layers=resident,
    )


class Profile(NamedTuple):
    degrees: ParallelDegrees
    offload: OffloadConfig
    shape: RequestShape
    compiled: bool


def pd(tp: int = 1, usp: int = 1, te: int = 1, vae: int = 1, world: int = 1) -> ParallelDegrees:
    return ParallelDegrees(tp, usp, 1, te, vae, world)


PRO5000X4 = pd(tp=2, usp=2, te=4, vae=4, world=4)
RTX4090X2 = pd(tp=2, te=2, vae=2, world=2)
RTX4090X4 = pd(tp=2, usp=2, te=4, vae=4, world=4)
PROFILES = {
    "rtx5090x2": Profile(pd(tp=2, te=2, vae=2, world=2), dlo(20), CANVAS, False),
    "usp4_whole_encoder": Profile(pd(usp=4, world=4), OffloadConfig(), CANVAS, False),
    "usp4_encoder_tp4": Profile(pd(usp=4, te=4, world=4), OffloadConfig(), CANVAS, False),
    "pro5000x4_t2va": Profile(PRO5000X4, OffloadConfig(), RequestShape(1344, 768, 124), True),
    "pro5000x4_fl2va": Profile(PRO5000X4, OffloadConfig(), FIRST_FRAME, True),
    "pro5000x2": Profile(pd(usp=2, te=2, vae=2, world=2), dlo(20), FIRST_FRAME, False),
    "pro5000x8": Profile(pd(tp=4, usp=2, te=8, vae=8, world=8), OffloadConfig(), FIRST_FRAME, True),
    "rtx4090x2": Profile(RTX4090X2, dlo(12), SMALL_T2VA, False),
    "rtx4090x4": Profile(RTX4090X4, dlo(12), SMALL_T2VA, False),
    "rtx4090x2_ref2va": Profile(RTX4090X2, dlo(12), SMALL_REF2VA, False),
    "rtx4090x4_ref2va": Profile(RTX4090X4, dlo(12), SMALL_REF2VA, False),
}


class Measurement(NamedTuple):
    profile: str
    kind: str  # "smi": an nvidia-smi sample (the plan's total); "reserved": rank 0's max_memory_reserved
    gib: float
    source: str


MEASURED = (
    Measurement("rtx5090x2", "smi", 22.6, "model card / vLLM-Omni MiniMax-H3.md, 2 x RTX 5090, eager"),
    Measurement("usp4_whole_encoder", "smi", 133e9 / GiB, "model card, 4 GPUs, Ulysses 4, '133 GB'"),
    Measurement("usp4_encoder_tp4", "smi", 103e9 / GiB, "model card, the same with text-encoder TP4, '103 GB'"),
    Measurement("pro5000x4_t2va", "smi", 69_219 * MiB / GiB, "MiniMax-H3-RTX-PRO-5000.md, maximum external sample"),
    Measurement("pro5000x4_t2va", "reserved", 65_314 * MiB / GiB, "the same, T2VA worker-reported peak"),
    Measurement("pro5000x4_fl2va", "reserved", 66_780 * MiB / GiB, "the same, first-frame FL2VA worker-reported peak"),
    Measurement("pro5000x2", "smi", 37_250 * MiB / GiB, "MiniMax-H3-RTX-PRO-5000.md, 2 GPUs, DLO, eager"),
    Measurement("pro5000x8", "smi", 45.83, "MiniMax-H3-RTX-PRO-5000.md, 8 GPUs, compiled"),
    Measurement("rtx4090x2", "reserved", 15.3, "MiniMax-H3-4090.md, 2 GPUs, T2VA"),
    Measurement("rtx4090x4", "reserved", 15.2, "MiniMax-H3-4090.md, 4 GPUs, T2VA"),
    Measurement("rtx4090x2_ref2va", "reserved", 14_918 * MiB / GiB, "MiniMax-H3-4090.md, 2 GPUs, Ref2VA"),
    Measurement("rtx4090x4_ref2va", "reserved", 16_448 * MiB / GiB, "MiniMax-H3-4090.md, 4 GPUs, Ref2VA, one run"),
)
# name: (planned total GiB as nvidia-smi, planned rank-0 reserved GiB) -- pinned planner figures
PLANNED = {
    "rtx5090x2": (22.53, 21.10),
    "usp4_whole_encoder": (130.83, 129.39),
    "usp4_encoder_tp4": (96.00, 94.25),
    "pro5000x4_t2va": (66.30, 63.99),
    "pro5000x4_fl2va": (66.47, 64.15),
    "pro5000x2": (35.29, 33.54),
    "pro5000x8": (44.42, 42.11),
    "rtx4090x2": (16.52, 15.08),
    "rtx4090x4": (16.78, 14.72),
    "rtx4090x2_ref2va": (16.52, 15.08),
    "rtx4090x4_ref2va": (16.78, 14.72),
}
# The 4 x RTX 4090 Ref2VA figure is one run (the recipe's follow-up requests failed) of a request whose reference
# image and audio the recipe does not state: the plan assumes one canvas-size image and no audio reference, the
# fewest rows a Ref2VA request can have; the 2-GPU Ref2VA run with the same inputs is 3.4% under its plan.
OUTSIDE_THE_BAND = {"rtx4090x4_ref2va": -0.083}


@pytest.fixture(scope="module")
def plans() -> dict[str, PlacementPlan]:
    out, inventories = {}, {}
    for name, p in PROFILES.items():
        dits = ("transformer_ref",) if p.shape.task == "ref2va" else ("transformer",)
        key = (p.degrees, dits)
        if key not in inventories:
            inventories[key] = build_inventory(RELEASED, p.degrees, dits, engine=VLLM_OMNI)
        runtime = Runtime(memo=False, compiled=p.compiled)
        out[name] = plan_placement(inventories[key], p.offload, p.shape, runtime=runtime)
    return out


def reserved(plan: PlacementPlan) -> float:
    """Rank 0's tensors + what the allocator's pool holds besides them at its worst stage: what
    max_memory_reserved reports, in GiB."""
    stages = plan.ranks[0].stages
    return max(s.tensor_bytes + sum(s.overhead.get(t, 0) for t in RESERVED_TERMS) for s in stages) / GiB


def planned(plan: PlacementPlan, kind: str) -> float:
    return plan.peak_device_bytes / GiB if kind == "smi" else reserved(plan)


@pytest.mark.slow
def test_every_measured_profile_is_pinned(plans):
    for name, (smi, alloc) in PLANNED.items():
        assert plans[name].peak_device_bytes / GiB == pytest.approx(smi, abs=0.011), name
        assert reserved(plans[name]) == pytest.approx(alloc, abs=0.011), name


@pytest.mark.slow
def test_every_measurement_within_minus_5_plus_15_percent_of_its_plan(plans):
    for m in MEASURED:
        error = planned(plans[m.profile], m.kind) / m.gib - 1
        if m.profile in OUTSIDE_THE_BAND:
            assert error == pytest.approx(OUTSIDE_THE_BAND[m.profile], abs=0.001), m
        else:
            assert -0.05 <= error <= 0.15, (m, f"{100 * error:+.1f}%")


@pytest.mark.slow
def test_the_stated_unmodelled_margin_is_the_measured_residuals(plans):
    """`h3serve plan` states UNMODELLED: measured / planned - 1 over every measurement, rounded outwards."""
    residuals = [m.gib / planned(plans[m.profile], m.kind) - 1 for m in MEASURED]
    assert len(residuals) == UNMODELLED_PROFILES
    low, high = UNMODELLED
    assert low <= min(residuals) < low + 0.001 and high - 0.001 < max(residuals) <= high


@pytest.mark.slow
def test_the_resident_routes_peak_in_the_whole_video_decode(plans):
    """Why the compiled resident PRO 5000 routes were ~11.7 GiB over h3serve's own plan, whatever the TP degree:
    vLLM-Omni keeps everything resident through a decode of the whole video in fp32 (four copies) with an fp32
    VAE, beside the denoise working set its allocator still holds. The DLO routes release the resident blocks and
    stage the VAE, so only the 4090s (small DiT share, 24 GiB) peak there; the others peak in denoise."""
    for name in ("usp4_whole_encoder", "usp4_encoder_tp4", "pro5000x4_t2va", "pro5000x8", "rtx4090x2", "rtx4090x4"):
        assert plans[name].ranks[0].peak_stage == "video_decode", name
    for name in ("rtx5090x2", "pro5000x2"):
        assert plans[name].ranks[0].peak_stage == "denoise", name
    # Ulysses 2 on 4 x RTX 4090 moved the measured peak by 0.1 GiB: the decode does not depend on it.
    assert abs(reserved(plans["rtx4090x2"]) - reserved(plans["rtx4090x4"])) < 0.5


@pytest.mark.slow
def test_h3serve_placed_the_same_way_plans_less_where_it_holds_less(plans):
    """The same resident quartet as h3serve runs it (its own plan, the default): bf16 decoder, streamed decode, no
    retained cache; 9.5 GiB lower, and it peaks in denoise."""
    p = PROFILES["pro5000x4_t2va"]
    own = plan_placement(
        build_inventory(RELEASED, p.degrees, ("transformer",), engine=H3SERVE),
        p.offload,
        p.shape,
        runtime=Runtime(memo=False, compiled=True),
    )
    assert own.ranks[0].peak_stage == "denoise"
    assert plans["pro5000x4_t2va"].peak_device_bytes / GiB - own.peak_device_bytes / GiB == pytest.approx(9.5, abs=0.1)
