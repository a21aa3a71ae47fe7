"""The layerwise flags stream the text encoder (staging it whole is the compact form's "staged"), and the
planner counts the streamed VAE decode; both on the model card's two-GPU recipes (released architecture)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from h3serve.config.offload_config import OffloadError, OffloadFlags, offload_config_from_flags
from h3serve.offload import activations
from h3serve.offload.activations import RequestShape
from h3serve.offload.inventory import RELEASED, build_inventory
from h3serve.offload.placement_plan import GiB
from h3serve.offload.planner import plan_placement
from h3serve.parallel.degrees import ParallelDegrees

DLO_LOCAL = OffloadFlags(enable_distributed_layerwise_offload=True, dlo_use_allgather=False)
STAGED_WHOLE = '{"mode": "layer", "components": ["dit", "vae", "audio_vae"], "staged": ["text_encoder"]}'


@pytest.fixture(scope="module")
def two_gpus():
    degrees = ParallelDegrees(tensor_parallel=2, text_encoder_tp=2, vae_patch_parallel=2, world_size=2)
    return build_inventory(RELEASED, degrees, ("transformer",))


@pytest.mark.parametrize("flags", [OffloadFlags(enable_layerwise_offload=True), DLO_LOCAL,
                                   OffloadFlags(enable_distributed_layerwise_offload=True)])
def test_layerwise_flags_stream_the_text_encoder_and_stage_the_vaes(flags):
    config = offload_config_from_flags(flags)
    assert config.streamed == {"dit", "text_encoder"} and config.staged == {"vae", "audio_vae"}


def test_the_compact_form_still_stages_the_encoder_whole():
    config = offload_config_from_flags(OffloadFlags(diffusion_offload_config=STAGED_WHOLE))
    assert config.streamed == {"dit"} and config.staged == {"text_encoder", "vae", "audio_vae"}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"mode": "layer", "staged": ["encoder"]}', "unknown staged components encoder"),
        ('{"mode": "layer", "components": ["dit", "text_encoder"], "staged": ["text_encoder"]}', "both components"),
        ('{"mode": "module", "staged": ["vae"]}', 'apply to mode "layer" only'),
        ('{"mode": "layer", "staged": "vae"}', "staged must be a list"),
    ],
)
def test_bad_staged_lists_are_refused(text, message):
    with pytest.raises(OffloadError, match=message):
        offload_config_from_flags(OffloadFlags(diffusion_offload_config=text))


def _peak(inv, flags: OffloadFlags, resident: int, shape: RequestShape) -> tuple[float, str]:
    config = replace(offload_config_from_flags(flags), resident_layers=resident)
    rank = max(plan_placement(inv, config, shape).ranks, key=lambda r: r.peak_device_bytes)
    return rank.peak_device_bytes / GiB, rank.peak_stage


def test_two_rtx_5090_recipe_peaks_in_denoise_once_the_encoder_streams(two_gpus):
    shape = RequestShape(1344, 768, 124, "fl2va")
    peak, stage = _peak(two_gpus, DLO_LOCAL, 20, shape)
    assert stage == "denoise" and peak < 22.6  # under vLLM-Omni's measured 22.6 GiB (AdaLN placement may lower it)
    whole = OffloadFlags(diffusion_offload_config=STAGED_WHOLE)
    peak, stage = _peak(two_gpus, whole, 20, shape)
    assert stage == "text_encode" and peak > 25.7  # the encoder's TP2 shard alone is 25.7 GiB


def test_two_rtx_4090_recipe_places_the_encoder_now(two_gpus):
    shape, device = RequestShape(1024, 576, 124, "fl2va"), 24_564 * 2**20 / GiB - 1.0  # nvidia-smi size, headroom
    assert _peak(two_gpus, DLO_LOCAL, 12, shape)[0] < device
    assert _peak(two_gpus, OffloadFlags(diffusion_offload_config=STAGED_WHOLE), 12, shape)[0] > device


def test_streamed_decode_working_set_is_one_clip_whatever_the_length(two_gpus):
    def decode(frames: int, streamed: bool, rank: int = 0) -> int:
        shape = RequestShape(1344, 768, frames, "fl2va", streamed_decode=streamed)
        return activations.stage_activations(two_gpus, rank, "video_decode", shape, "transformer")

    assert decode(124, True) < 0.5 * decode(124, False)
    assert decode(736, True) == decode(124, True) < 0.1 * decode(736, False)  # 30 s: bounded
    assert decode(736, True, rank=1) == decode(124, True, rank=1) < decode(736, False, rank=1)
