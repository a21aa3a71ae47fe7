"""The placement plan at engine start-up: logged, a configuration that cannot fit refused before a weight is read,
`--dlo-resident-layers auto` resolved to the largest K that fits."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from h3serve.config.engine_config import EngineConfig
from h3serve.config.offload_config import OffloadConfig
from h3serve.errors import ConfigError
from h3serve.offload.placement_plan import GiB
from h3serve.offload.request_shapes import longest_pass
from h3serve.rank.model_runner import ModelRunner
from h3serve.rank.placement import long_request_refusal, placement_for_engine, plan_for_engine

CPU = torch.device("cpu")
AUTO_DLO = OffloadConfig(
    staged=frozenset({"text_encoder", "vae", "audio_vae"}),
    streamed=frozenset({"dit"}),
    distributed=True,
    transfer="rank-local",
    resident_layers="auto",
)


def _config(checkpoint, **kw) -> EngineConfig:
    return EngineConfig(model=checkpoint, device="cpu", threads=1, task_type="fl2va", **kw)


def _peak_with(checkpoint, k: int) -> int:
    config = _config(checkpoint, offload=replace(AUTO_DLO, resident_layers=k))
    return plan_for_engine(config, None).peak_device_bytes


def test_the_engine_runs_the_resident_layers_auto_resolves(tiny_checkpoint, capsys):
    # On the tiny checkpoint the VAE decode, not the DiT, sets the peak: every block fits, so auto keeps all six
    # (the planner's own choice between K values is tested on the released model in test_planner).
    memory = _peak_with(tiny_checkpoint, 6) + GiB
    engine = ModelRunner(_config(tiny_checkpoint, offload=AUTO_DLO, device_memory=memory))
    assert engine.config.offload.resident_layers == engine.placement.resident_layers == 6
    assert len(engine.offload.prefix) == 6 and engine.offload.streams["transformer"][0].units  # the refiner streams
    log = capsys.readouterr().err
    assert "placement plan" in log and "rank 0: peak" in log and "fits: peak" in log


def test_a_configuration_that_cannot_fit_is_refused_before_loading(tiny_checkpoint):
    # 64 MiB: less than the 1 GiB headroom alone. A full decode: the tiny checkpoint's peak is then its video
    # decode (streamed, its audio decode is).
    config = _config(tiny_checkpoint, device_memory=64 * 2**20, decode_mode="full")
    refused = r"does not fit the device: rank 0 needs .* GiB in video_decode .* \(short by .* GiB\); offload more"
    with pytest.raises(ConfigError, match=refused):
        ModelRunner(config)
    with pytest.raises(ConfigError, match="--dlo-resident-layers auto: even with 0 resident blocks"):
        placement_for_engine(_config(tiny_checkpoint, offload=AUTO_DLO, device_memory=64 * 2**20), CPU)


def test_auto_needs_a_device_size_on_cpu(tiny_checkpoint):
    with pytest.raises(ConfigError, match="needs the device size; give --device-memory"):
        placement_for_engine(_config(tiny_checkpoint, offload=AUTO_DLO), CPU)


def test_generate_refuses_at_start_up_with_one_line(tiny_checkpoint, tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "h3serve", "generate", "a fox", "-o", str(tmp_path / "out.mp4"),
         "--model", str(tiny_checkpoint), "--device", "cpu", "--device-memory", "64MiB", "--steps", "1"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode != 0 and not (tmp_path / "out.mp4").exists()
    error = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(error) == 1 and "does not fit the device" in error[0] and "Traceback" not in result.stderr
    assert "denoise:" not in result.stderr  # no step ran: refused before the weights were loaded


def test_serve_engine_refuses_at_start_up_not_at_the_first_request(tiny_checkpoint):
    # `h3serve serve` starts its engine through the executor: the rank reports the plan's refusal as a start-up
    # failure, before any request (the API process never imports torch, so the plan runs in the rank).
    from h3serve.engine.executor import EngineError, Executor

    with pytest.raises(EngineError, match="does not fit the device"):
        Executor(_config(tiny_checkpoint, device_memory=64 * 2**20))


def test_a_flag_only_the_rank_can_check_is_refused_at_start_up_as_that_config_error(tiny_checkpoint):
    # The API process cannot tell which attention kernels this device has (torch): the rank's start-up check
    # refuses it before loading, and the executor raises it as the ConfigError, message unchanged.
    from h3serve.engine.executor import Executor

    with pytest.raises(ConfigError, match="^--diffusion-attention-backend FLASH_ATTN: needs a CUDA device; available"):
        Executor(_config(tiny_checkpoint, attention_backend="FLASH_ATTN"))


def test_long_request_verdict_before_it_starts(tiny_checkpoint):
    """With the full decode a 30 s one-pass request needs ~6x the activations of 5 s (the whole video is held):
    refused on a device the default request fits. Streamed (the default), the video decodes one clip and the
    soundtrack one window at a time, so the same request fits there."""
    from h3serve.rules.request import GenerationRequest
    from h3serve.rules.validate import validate

    config = EngineConfig(model=tiny_checkpoint, decode_mode="full")
    full = validate(GenerationRequest(prompt="x", width=96, height=64, duration_s=30, long_video=True))
    message = long_request_refusal(config, full, 3 * GiB // 2)  # ~1 GiB of activations + 1 GiB headroom
    assert message and "longest pass (736 frames at 96x64)" in message and "on a 1.50 GiB device" in message
    assert long_request_refusal(EngineConfig(model=tiny_checkpoint), full, 3 * GiB // 2) is None
    assert long_request_refusal(config, full, 4 * GiB) is None
    assert long_request_refusal(config, full, None) is None  # no device size: no verdict
    ordinary = validate(GenerationRequest(prompt="x", width=96, height=64, duration_s=15))
    assert long_request_refusal(config, ordinary, 3 * GiB // 2) is None  # not long: the start-up plan covers it
    windows = validate(
        GenerationRequest(
            prompt="x", width=96, height=64, duration_s=60, long_video=True, long_video_mode="continuation"
        )
    )
    assert longest_pass(windows).num_frames == 277 and long_request_refusal(config, windows, 3 * GiB // 2) is None
    # An edit encodes its source video (one VAE clip at a time, counted): it is put to the planner too.
    from h3serve.rules.request import MediaRef

    edit = replace(ordinary, source_video=MediaRef(Path("source.mp4"), "source.mp4"))
    assert longest_pass(edit).source_frames == ordinary.num_frames and longest_pass(ordinary).source_frames == 0
    from h3serve.rules.request import ControlRequest

    inpaint = replace(ordinary, control=ControlRequest("inpaint", source=edit.source_video, mask=edit.source_video))
    assert longest_pass(inpaint).control_channels == 4 and longest_pass(ordinary).control_channels == 0
    assert "longest pass (362 frames at 96x64)" in long_request_refusal(config, edit, GiB // 4)
    assert long_request_refusal(config, ordinary, GiB // 4) is None
    # Timeline guides lengthen the sequence by their latent frames' rows (each one canvas-sized latent frame, as a
    # condition image): a guided request is put to the planner too.
    from h3serve.rules.guides import PlacedGuide

    guided = replace(ordinary, guides=(PlacedGuide(0, 1, MediaRef(Path("g.png"), "g.png", "image")),
                                       PlacedGuide(100, 22, MediaRef(Path("c.mp4"), "c.mp4", "video"))))
    assert longest_pass(guided).images == longest_pass(ordinary).images + 1 + 7
    assert "fewer or shorter timeline guides" in long_request_refusal(config, guided, GiB // 4)


def test_several_outputs_batch_as_many_as_the_planner_fits(tiny_checkpoint):
    """The denoise activations grow with the batch; the engine batches the most outputs (up to
    --max-output-batch) whose plan fits the device, one at a time when two do not, all of them without a size."""
    from h3serve.offload.request_shapes import DEFAULT_HEADROOM
    from h3serve.rank.placement import output_batch
    from h3serve.rules.request import GenerationRequest
    from h3serve.rules.validate import validate

    # Whole rows (a running engine's row chunk is resolved at start-up; `auto` would chunk to fit).
    config = EngineConfig(model=tiny_checkpoint, max_output_batch=4, denoise_chunk_rows=None)
    # 1024x512: the tiny DiT's denoise activations pass its other stages' from three items on.
    plan = validate(GenerationRequest(prompt="x", width=1024, height=512, duration_s=4, num_outputs=6))
    shape = longest_pass(plan)
    peaks = [plan_for_engine(config, 64 * GiB, replace(shape, batch=b)).peak_device_bytes for b in (1, 2, 3, 4)]
    assert peaks[1] < peaks[2] < peaks[3]  # every item adds its activations
    assert output_batch(config, plan, None) == 4 and output_batch(config, plan, 64 * GiB) == 4
    assert output_batch(config, plan, peaks[2] + DEFAULT_HEADROOM) == 3
    assert output_batch(config, plan, peaks[2] + DEFAULT_HEADROOM - 1) == 2
    assert output_batch(config, plan, peaks[0] // 2) == 1  # not even one fits: the start-up plan refused that
    assert output_batch(replace(config, max_output_batch=1), plan, 64 * GiB) == 1
    assert output_batch(config, replace(plan, num_outputs=3), None) == 3


def test_the_plan_counts_the_prompt_cache_and_a_merged_adapter_adds_no_factors(tiny_checkpoint, tmp_path):
    from h3serve.offload.lora_bytes import ADAPTERS
    from h3serve.offload.placement_plan import PROMPT_CACHE
    from h3serve.offload.plan_report import format_plan
    from h3serve.tools.tiny.make_adapter import write_peft_adapter

    plan = plan_for_engine(_config(tiny_checkpoint, prompt_cache_bytes=3 * 2**20), None)
    assert all(r.host_bytes[PROMPT_CACHE] == 3 * 2**20 for r in plan.ranks)
    assert "prompt cache" in format_plan(plan, "plan")
    off = plan_for_engine(_config(tiny_checkpoint, prompt_cache_bytes=None), None)
    assert PROMPT_CACHE not in off.ranks[0].host_bytes
    cfg = json.loads((tiny_checkpoint / "transformer" / "config.json").read_text())
    adapter = str(write_peft_adapter(tmp_path / "a", cfg).parent)
    unmerged = plan_for_engine(_config(tiny_checkpoint, lora_paths=(("a", adapter),)), None)
    merged = plan_for_engine(_config(tiny_checkpoint, lora_paths=(("a", adapter),), merge_lora=True), None)
    assert ADAPTERS in unmerged.ranks[0].host_bytes and ADAPTERS not in merged.ranks[0].host_bytes
    assert merged.peak_device_bytes < unmerged.peak_device_bytes  # no factors in the blocks, no device cache
