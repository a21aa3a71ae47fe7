"""Device bookkeeping of the sampler and of continuation windows (issue 24, defect 1).

On a GPU, `Sampler.sample` returns a window's latents on the device; they become the next window's guide and are mixed
with noise drawn on the CPU, and an extension's window 0 (VAE-encoded) must join the generated windows. The CPU
cannot show a cross-device mix with CPU tensors alone, so the pipeline runs with the `meta` device as its compute
device: every op that mixes a host tensor into device ones raises, exactly as a CUDA device would.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from h3serve.model.pipeline import H3Pipeline
from h3serve.model.pipeline_types import Conditioning, GenerationResult
from h3serve.rules.request import GenerationRequest, MediaRef
from h3serve.rules.validate import validate

META = torch.device("meta")


class DeviceRecorder:
    """Stands in for the denoise loop and the decode on the `meta` pipeline, recording what they are handed."""

    def __init__(self, pipeline: H3Pipeline, monkeypatch, result=None):
        self.denoised: list[tuple[torch.device, torch.device]] = []
        self.decoded: list[torch.device] = []
        self.guides: list[torch.device] = []
        run_window = pipeline.continuation.run_window

        def denoise(schedules, dit, layout, text_states, video_rows, audio_rows, on_step=None, edits=(None, None),
                    solver="euler", hooks=None, control=None):
            self.denoised.append((video_rows.device, audio_rows.device))
            return video_rows, audio_rows

        def window(plan, window, media, text, origin, guide, clock, on_step, locked=None):
            if guide is not None:
                self.guides += [guide.video.device, guide.audio.device]
            return run_window(plan, window, media, text, origin, guide, clock, on_step, locked)

        def decode(video, audio, clock, cache, *sink):
            self.decoded += [video.device, audio.device]
            return (video, audio) if result is None else result

        monkeypatch.setattr(pipeline.sampler, "denoise", denoise)
        monkeypatch.setattr(pipeline.continuation, "run_window", window)
        monkeypatch.setattr(pipeline.decoder, "decode", decode)


def test_continuation_windows_hand_on_device_tensors(tiny_pipeline, monkeypatch):
    loaded, defaults = tiny_pipeline
    pipeline = H3Pipeline(loaded.components, device=META)
    recorder = DeviceRecorder(pipeline, monkeypatch)
    plan = validate(GenerationRequest(
        prompt="a beach", width=32, height=32, steps=1, seed=3, duration_s=20, long_video=True,
        long_video_mode="continuation", continuation_window_frames=345), defaults)
    assert len(plan.windows) >= 2  # at least one guide is carried from a generated window
    video, audio = pipeline.generate(plan)
    assert recorder.denoised == [(META, META)] * len(plan.windows)
    assert recorder.guides == [META, META] * (len(plan.windows) - 1)
    assert recorder.decoded == [META, META] and (video.device, audio.device) == (META, META)


def test_an_extensions_source_window_joins_the_generated_ones_on_the_device(tiny_pipeline, monkeypatch):
    loaded, defaults = tiny_pipeline
    pipeline = H3Pipeline(loaded.components, device=META)
    # The decode hands the frames back to the host (a real result); the source's frames are written over its start.
    host = GenerationResult(torch.zeros(243, 32, 32, 3), torch.zeros(2, 32_000 * 11), torch.zeros(0), torch.zeros(0))
    recorder = DeviceRecorder(pipeline, monkeypatch, host)
    plan = validate(GenerationRequest(
        prompt="on", width=32, height=32, steps=1, duration_s=4, long_video=True, long_video_mode="continuation",
        extend_video=MediaRef(Path("/s.mp4"), "s.mp4", "video")), defaults, extend_frames=150)
    # The source's VAE encode returns host latents (conditioning.encode_visual_condition), as on a GPU box; their
    # values do not matter here, so the (slow) encode itself is skipped.
    source = torch.randn(1, 24, plan.windows[0].latent_frames, plan.latent_height, plan.latent_width)
    monkeypatch.setattr(pipeline.encoder, "source_frames", lambda frames: source.clone())
    frames = np.random.default_rng(2).integers(0, 255, (141, 32, 32, 3), dtype=np.uint8)
    window = pipeline.continuation.extension_source(plan, Conditioning(extend_video=frames), plan.windows[0],
                                                    _clock(pipeline))
    assert [t.device for t in window] == [META, META]
    result = pipeline.continuation.generate(plan, Conditioning(extend_video=frames), _clock(pipeline), None)
    assert recorder.guides == [META, META] and recorder.decoded == [META, META]
    assert torch.equal(result.video[:141], torch.from_numpy(frames) / 255)


def _clock(pipeline: H3Pipeline):
    from h3serve.model.pipeline_types import StageClock

    return StageClock(pipeline.device)


class _MetaDiT(torch.nn.Module):
    """A weightless stand-in DiT: velocities shaped like its inputs, wherever they are."""

    def embed_text(self, text: torch.Tensor) -> torch.Tensor:
        return text

    def forward(self, video, audio, text, timestep, row_index, packed, modulation=None, step=None, control=None):
        assert timestep.device == row_index.device == video.device == META
        return video * 0, audio * 0


def _host_to_device_copies(pipeline: H3Pipeline, enc, steps: int, edits, solver: str = "euler") -> int:
    """How many host -> device copies, and device reads, one denoise loop of `steps` forwards issues."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from h3serve.model.scheduler import FlowSchedule

    class Count(TorchDispatchMode):
        copies = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            source = args[0] if args and isinstance(args[0], torch.Tensor) else None
            if func is torch.ops.aten._local_scalar_dense.default and source.device.type != "cpu":
                raise AssertionError("a step read a device value back (.item())")
            if func is torch.ops.aten._to_copy.default and source is not None and source.device.type == "cpu":
                Count.copies += torch.device(kwargs.get("device", source.device)) == META
            return func(*args, **kwargs)

    video = torch.zeros(1, enc.layout.packed.video_indices.numel(), 96, device=META)
    audio = torch.zeros(1, enc.layout.packed.audio_indices.numel(), 32, device=META)
    schedules = (FlowSchedule.shifted(steps, 12.0), FlowSchedule.shifted(steps, 3.0))
    with Count():
        pipeline.sampler.denoise(schedules, _MetaDiT(), enc.layout, enc.text_states, video, audio, None, edits,
                                 solver=solver)
    return Count.copies


def test_a_denoise_step_makes_no_host_to_device_copy(tiny_pipeline):
    """Timesteps, row indices and sigmas move to the device once per request (issue 24, defect 10): the copies a
    loop makes do not grow with its steps, with or without a latent-mask edit's per-row timesteps, with either
    solver."""
    from h3serve.model.latent_edit import audio_target

    loaded, defaults = tiny_pipeline
    plan = validate(GenerationRequest(prompt="a beach", width=32, height=32, steps=1, duration_s=4), defaults)
    enc = loaded.encode(plan, Conditioning())
    pipeline = H3Pipeline(loaded.components, device=META)
    rows = enc.layout.packed.audio_indices.numel()
    grid = torch.zeros(2, rows // 2)
    grid[:, rows // 4 :] = 1.0
    edit = audio_target(torch.randn(rows, 32), grid)
    edit.set_anchor(torch.randn(rows, 32))
    for edits in ((None, None), (None, edit)):
        for solver in ("euler", "res_multistep"):  # RES weights go to the device with the sigmas
            few, many = (_host_to_device_copies(pipeline, enc, steps, edits, solver) for steps in (2, 6))
            assert few == many > 0, (edits, solver)
