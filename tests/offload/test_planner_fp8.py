"""The planner's FP8 verdicts on the released architecture (configs on the meta device, no weights), as
docs/memory.md reports them: H3 on one 32 GB GPU with an FP8 DiT, its AdaLN projections in host memory and the
text encoder streamed; on one 48 GB GPU; and how many DiT blocks 2 x RTX 4090 keep resident under DLO."""

from __future__ import annotations

from dataclasses import replace

import pytest

from h3serve.config.offload_config import OffloadFlags, offload_config_from_flags
from h3serve.config.quantization_config import parse_quantization
from h3serve.offload.activations import RequestShape
from h3serve.offload.inventory import RELEASED, build_inventory
from h3serve.offload.placement_plan import GiB
from h3serve.offload.planner import plan_placement
from h3serve.parallel.degrees import ParallelDegrees

pytestmark = pytest.mark.slow  # four released-architecture inventories on the meta device: ~30 s of CPU
MiB = 2**20
RTX_5090, RTX_4090, GPU_48GB = 32_607 * MiB, 24_564 * MiB, 48 * 10**9  # nvidia-smi sizes; 48 GB nominal
FP8 = parse_quantization("fp8", None)
# The FP8 encoder streamed layer by layer, the VAEs staged, the AdaLN projections in host memory.
ONE_GPU = '{"mode": "layer", "components": ["adaln", "text_encoder", "vae", "audio_vae"]}'
ADALN_ON_DEVICE = '{"mode": "layer", "components": ["text_encoder", "vae", "audio_vae"]}'
DLO_LOCAL = OffloadFlags(enable_distributed_layerwise_offload=True, dlo_use_allgather=False)


@pytest.fixture(scope="module")
def one_gpu():
    return {q: build_inventory(RELEASED, dits=("transformer",), quantization=q) for q in (None, FP8)}


@pytest.fixture(scope="module")
def two_gpus():
    degrees = ParallelDegrees(tensor_parallel=2, text_encoder_tp=2, vae_patch_parallel=2, world_size=2)
    return {q: build_inventory(RELEASED, degrees, ("transformer",), quantization=q) for q in (None, FP8)}


def _verdict(inv, text: str, task: str, device: int, frames: int = 124):
    config = offload_config_from_flags(OffloadFlags(diffusion_offload_config=text))
    plan = plan_placement(inv, config, RequestShape(1344, 768, frames, task), device, 1 * GiB)
    rank = plan.ranks[0]
    return plan.fits, rank.peak_device_bytes / GiB, rank.peak_stage


# docs/memory.md: T2VA at 5 s (124 frames) peaks at 30.02 GiB, FL2VA (two keyframes) at 107 frames at 29.94 GiB.
@pytest.mark.parametrize(("task", "frames"), [("t2va", 124), ("fl2va", 107)])
def test_fp8_dit_with_adaln_on_the_host_fits_one_32gb_gpu(one_gpu, task, frames):
    fits, peak, stage = _verdict(one_gpu[FP8], ONE_GPU, task, RTX_5090, frames)
    assert fits and stage == "denoise"
    assert 28.0 < peak < RTX_5090 / GiB - 1.0  # inside the 1 GiB headroom, runtime overhead included
    # Neither half alone fits: bf16 with AdaLN on the host, or FP8 with the AdaLN projections on the device.
    for inv, text in ((one_gpu[None], ONE_GPU), (one_gpu[FP8], ADALN_ON_DEVICE)):
        assert _verdict(inv, text, task, RTX_5090, frames)[0] is False


def test_fp8_fl2va_at_five_seconds_misses_one_32gb_gpu_by_less_than_half_a_gib(one_gpu):
    fits, peak, stage = _verdict(one_gpu[FP8], ONE_GPU, "fl2va", RTX_5090)
    assert not fits and stage == "denoise"  # 31.00 GiB + 1 GiB headroom against 31.84 GiB
    assert 0 < peak + 1.0 - RTX_5090 / GiB < 0.5


def test_one_48gb_gpu_fits_fp8_only_with_adaln_on_the_host(one_gpu):
    fits, peak, stage = _verdict(one_gpu[FP8], ONE_GPU, "fl2va", GPU_48GB)
    assert fits and stage == "denoise" and peak == pytest.approx(31.00, abs=0.5)
    fits, peak, stage = _verdict(one_gpu[FP8], ADALN_ON_DEVICE, "fl2va", GPU_48GB)
    assert not fits and stage == "denoise" and peak > GPU_48GB / GiB + 5  # 55.24 GiB: the bf16 AdaLN (24.29 GiB)
    assert _verdict(one_gpu[None], ONE_GPU, "fl2va", GPU_48GB)[0] is False  # bf16: 49.36 GiB


def _resident(inv, resident: int | str) -> tuple[int, float]:
    config = replace(offload_config_from_flags(DLO_LOCAL), resident_layers=resident)
    plan = plan_placement(inv, config, RequestShape(1024, 576, 124, "fl2va"), RTX_4090, 1 * GiB)
    assert plan.fits and all(r.peak_stage == "denoise" for r in plan.ranks)
    return plan.resident_layers, max(r.peak_device_bytes for r in plan.ranks) / GiB


def test_two_rtx_4090_keep_every_block_resident_in_fp8(two_gpus):
    assert _resident(two_gpus[None], 12)[0] == 12  # the model card's bf16 recipe
    k_bf16, _ = _resident(two_gpus[None], "auto")
    k_fp8, peak = _resident(two_gpus[FP8], "auto")
    assert k_bf16 < 50 and k_fp8 == 50  # docs/memory.md: bf16 auto 39 (22.63 GiB), FP8 50 (17.35 GiB)
    assert peak < RTX_4090 / GiB - 1.0
