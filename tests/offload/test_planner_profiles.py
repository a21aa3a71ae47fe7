"""The planner against every measured profile of the model card and vLLM-Omni's H3 recipes (`docs/memory.md`).

`--preset released` on the meta device, as vLLM-Omni ran each profile: the AdaLN projections inside their blocks
(memo off), compiled where the recipe compiles. nvidia-smi figures are compared with tensors + runtime overhead,
the allocator's reserved peaks (`x-peak-memory-mb`) with tensors + the allocator's reserve. Each planned figure is
pinned (a change to the planner moves these numbers on purpose, and docs/memory.md with them); the error against
the measurement is asserted where the planner explains the measurement, and stated in the docs where it does not.
"""

from __future__ import annotations

from typing import NamedTuple

import pytest

from h3serve.offload.activations import RequestShape
from h3serve.offload.inventory import RELEASED, build_inventory
from h3serve.offload.modes import OffloadConfig
from h3serve.offload.placement_plan import GiB, PlacementPlan
from h3serve.offload.planner import Runtime, plan_placement
from h3serve.parallel.degrees import ParallelDegrees

MiB = 2**20
CANVAS = RequestShape(1344, 768, 124, "fl2va")  # two keyframes at the canvas size (the CLI's FL2VA shape)
FIRST_FRAME = RequestShape(1344, 768, 124, "fl2va", condition_images=1)  # the recipes' first-frame FL2VA
SMALL_T2VA = RequestShape(1024, 576, 124, "t2va", steps=60)


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


PROFILES = {
    "rtx5090x2": Profile(pd(tp=2, te=2, vae=2, world=2), dlo(20), CANVAS, False),
    "usp4_whole_encoder": Profile(pd(usp=4, world=4), OffloadConfig(), CANVAS, False),
    "usp4_encoder_tp4": Profile(pd(usp=4, te=4, world=4), OffloadConfig(), CANVAS, False),
    "pro5000x4_t2va": Profile(
        pd(tp=2, usp=2, te=4, vae=4, world=4), OffloadConfig(), RequestShape(1344, 768, 124), True
    ),
    "pro5000x4_fl2va": Profile(pd(tp=2, usp=2, te=4, vae=4, world=4), OffloadConfig(), FIRST_FRAME, True),
    "pro5000x2": Profile(pd(usp=2, te=2, vae=2, world=2), dlo(20), FIRST_FRAME, False),
    "pro5000x8": Profile(pd(tp=4, usp=2, te=8, vae=8, world=8), OffloadConfig(), FIRST_FRAME, True),
    "rtx4090x2": Profile(pd(tp=2, te=2, vae=2, world=2), dlo(12), SMALL_T2VA, False),
    "rtx4090x4": Profile(pd(tp=2, usp=2, te=4, vae=4, world=4), dlo(12), SMALL_T2VA, False),
}
# name: (planned nvidia-smi peak GiB, planned tensor + allocator reserve GiB) -- pinned planner figures (h3serve's
# communicators: with one sequence axis its group is the sequence group, one NCCL communicator fewer than vLLM-Omni)
PLANNED = {
    "rtx5090x2": (23.26, 21.82),
    "usp4_whole_encoder": (119.96, 118.83),
    "usp4_encoder_tp4": (85.53, 84.09),
    "pro5000x4_t2va": (55.95, 53.95),
    "pro5000x4_fl2va": (56.10, 54.10),
    "pro5000x2": (34.53, 33.09),
    "pro5000x8": (34.33, 32.33),
    "rtx4090x2": (15.47, 14.03),
    "rtx4090x4": (14.15, 12.40),
}


@pytest.fixture(scope="module")
def plans() -> dict[str, PlacementPlan]:
    out, inventories = {}, {}
    for name, p in PROFILES.items():
        if p.degrees not in inventories:
            inventories[p.degrees] = build_inventory(RELEASED, p.degrees, ("transformer",))
        runtime = Runtime(memo=False, compiled=p.compiled)
        out[name] = plan_placement(inventories[p.degrees], p.offload, p.shape, runtime=runtime)
    return out


def reserved(plan: PlacementPlan) -> float:
    """Rank 0's tensors + allocator reserve at its worst stage: what max_memory_reserved reports, in GiB."""
    stages = plan.ranks[0].stages
    return max(s.tensor_bytes + s.overhead.get("allocator_reserve", 0) for s in stages) / GiB


@pytest.mark.slow
def test_every_measured_profile_is_pinned(plans):
    for name, (smi, alloc) in PLANNED.items():
        assert plans[name].peak_device_bytes / GiB == pytest.approx(smi, abs=0.011), name
        assert reserved(plans[name]) == pytest.approx(alloc, abs=0.011), name
        assert all(r.peak_stage == "denoise" for r in plans[name].ranks), name


@pytest.mark.slow
def test_nvidia_smi_figures_within_15_percent_where_the_planner_explains_them(plans):
    measured = {  # nvidia-smi samples, GiB
        "rtx5090x2": 22.6,  # model card, eager
        "usp4_whole_encoder": 133e9 / GiB,  # model card, "133 GB"
        "usp4_encoder_tp4": 103e9 / GiB,
        "pro5000x2": 37_250 * MiB / GiB,  # vLLM-Omni RTX PRO 5000 recipe, DLO, eager
    }
    for name, value in measured.items():
        assert plans[name].peak_device_bytes / GiB == pytest.approx(value, rel=0.15), name


@pytest.mark.slow
def test_compiled_resident_pro5000_routes_miss_by_the_same_constant(plans):
    """4 and 8 x RTX PRO 5000, everything resident and compiled: 67.60 and 45.83 GiB measured. The planner is
    about 11.7 GiB under in both, whatever the TP degree: a per-rank term the planner does not model (docs)."""
    gap4 = 69_219 * MiB / GiB - plans["pro5000x4_fl2va"].peak_device_bytes / GiB
    gap8 = 45.83 - plans["pro5000x8"].peak_device_bytes / GiB
    assert 10.5 < gap4 < 12.5 and 10.5 < gap8 < 12.5 and abs(gap4 - gap8) < 0.5
    # The allocator's own peak (66,780 MiB, first-frame FL2VA) shows the same gap: it is in the tensors.
    assert 66_780 * MiB / GiB - reserved(plans["pro5000x4_fl2va"]) > 10
