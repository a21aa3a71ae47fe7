"""The two sides a bench worker can run: the h3serve engine and the diffusers reference pipeline.

Both load everything in their constructor (so no measured run pays for loading), take the same
`GenerationRequest`, resolve it with the same rules, and return host arrays plus stage durations.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch import nn

from h3serve.checkpoint.resolver import read_layout
from h3serve.config.engine_config import EngineConfig
from h3serve.engine.executor import Executor
from h3serve.engine.planning import plan_request
from h3serve.media.mp4 import EncoderOptions
from h3serve.media.sink import Mp4Sink
from h3serve.model.transformer import H3TransformerConfig
from h3serve.offload.activations import RequestShape
from h3serve.offload.plan_report import plan_json
from h3serve.rank.device_checks import resolve_device, resolve_dtype
from h3serve.rank.model_runner import ModelRunner
from h3serve.rank.placement import device_memory_of, plan_for_engine
from h3serve.rank.warmup import warm_up
from h3serve.rules.request import GenerationRequest
from h3serve.rules.validate import GenerationPlan
from h3serve.tools.bench.flops import ForwardShape
from h3serve.tools.bench.peer import load_reference_pipeline, reference_inputs, timed_stages

ShapeOf = Callable[[tuple, dict], ForwardShape]


@dataclass
class RunOutput:
    video: np.ndarray | None  # [T, H, W, 3] float32 in [0, 1]; None when streamed into the MP4
    audio: np.ndarray  # [2, N] float32
    stage_durations: dict[str, float]
    plan: GenerationPlan
    placement: dict | None = None  # the memory planner's plan for this request (plan_json), h3serve side only;
    # filled by the bench after the clocks stopped (H3Runner.placement)
    streamed_frames: int = 0
    streamed: dict[str, int] | None = None  # "stage/component" -> bytes the offload hooks copied in (one rank)
    stage_timeline: list[tuple[str, float, float]] | None = None  # (stage, start, end) on the time.monotonic clock

    @property
    def num_frames(self) -> int:
        return self.streamed_frames if self.video is None else int(self.video.shape[0])


class H3Runner:
    """The h3serve engine: in-process for one rank, the rank executor for more.

    `tasks` is unused: the engine config's `task_type` decides which DiTs load.
    """

    name = "h3serve"

    def __init__(self, config: EngineConfig, tasks: tuple[str, ...]):
        self.config = config
        self.device = resolve_device(config)
        self.dtype = resolve_dtype(config, self.device)
        self.local = ModelRunner(config) if config.world_size == 1 else None
        if self.local is not None and config.warmup:  # as `serve --warmup` does before it reports ready
            warm_up(self.local)
        self.engine: ModelRunner | Executor = self.local or Executor(config)

    def run(self, request: GenerationRequest, mp4_path: str | None = None) -> RunOutput:
        """One request; with `mp4_path` (and `decode_mode: stream`) its video is streamed into that MP4."""
        plan = self.local.plan(request) if self.local else plan_request(request, self.engine.defaults)
        if mp4_path is None:
            out = self.engine.generate(plan)
        elif self.local is not None:
            out = self.local.generate(plan, sink=Mp4Sink(mp4_path, batch_frames=plan.preencode_batch_frames,
                                                         device=self.local.device))
        else:
            out = self.engine.generate(plan, encoder=EncoderOptions())
            shutil.move(out.files.pop("video"), mp4_path)
            for path in out.files.values():
                Path(path).unlink(missing_ok=True)
        audio = out.audio if out.audio is not None else np.zeros((2, 0), np.float32)  # streamed by the ranks
        log = self.local.offload.log if self.local else None
        streamed = {f"{stage}/{c}": n for (stage, c), n in log.streamed.items()} if log is not None else None
        return RunOutput(out.video, audio, dict(out.stage_durations), plan, None, out.num_frames, streamed,
                         list(out.stage_timeline))

    def placement(self, plan: GenerationPlan) -> dict:
        """What the memory planner predicts for exactly this request's shape (for the record, beside the measured
        peak; computed after the request's clocks stopped)."""
        shape = RequestShape(plan.width, plan.height, plan.num_frames, plan.task, steps=plan.steps)
        config = self.local.config if self.local else self.config  # `auto` resident layers resolved
        return plan_json(plan_for_engine(config, device_memory_of(config, self.device), shape))

    def clear_prompt_cache(self) -> None:
        """Empty the in-process engine's prompt cache (a multi-rank engine's ranks cannot be reached from here: a cold
        bench runs it without one, h3serve.tools.bench.matrix_run)."""
        cache = self.local.pipeline.components.text.cache if self.local else None
        if cache is not None:
            cache.clear()

    def dits(self) -> list[tuple[nn.Module, H3TransformerConfig, ShapeOf]]:
        """The in-process DiTs with their configs; empty for multi-rank engines (they live in other processes)."""
        if self.local is None:
            return []
        dits = [self.local.pipeline.components.transformer, self.local.pipeline.components.transformer_ref]
        return [(m, m.config, h3_shape) for m in dits if m is not None]

    def close(self) -> None:
        if isinstance(self.engine, Executor):
            self.engine.close()


def h3_shape(args: tuple, kwargs: dict) -> ForwardShape:
    video, audio, text, timestep = args[:4]  # H3Transformer.forward(video, audio, text, timestep, ...)
    return ForwardShape(video.shape[1], audio.shape[1], text.shape[1], timestep.numel())


def _diffusers_shape(args: tuple, kwargs: dict) -> ForwardShape:
    # The reference pipeline calls its transformer with keyword arguments only.
    return ForwardShape(
        kwargs["hidden_states"].shape[1],
        kwargs["audio_hidden_states"].shape[1],
        kwargs["encoder_hidden_states"].shape[1],
        kwargs["timestep"].numel(),
    )


class DiffusersRunner:
    """The diffusers reference pipeline, one per task, on the same checkpoint, device and dtype."""

    name = "diffusers"

    def __init__(self, config: EngineConfig, tasks: tuple[str, ...]):
        if config.world_size != 1:
            raise ValueError("--peer diffusers runs in one process; use it with single-rank engine configs")
        self.device = resolve_device(config)
        self.dtype = resolve_dtype(config, self.device)
        self.defaults = read_layout(config.model, config.dits).defaults()
        self.pipes = {t: load_reference_pipeline(config.model, t, self.dtype, self.device) for t in tasks}
        self._forwards = 0
        for task, pipe in self.pipes.items():
            pipe.set_progress_bar_config(disable=True)
            self._dit(task).register_forward_pre_hook(self._count)

    def _dit(self, task: str) -> nn.Module:
        return self.pipes[task].transformer_ref if task == "ref2va" else self.pipes[task].transformer

    def _count(self, *_: object) -> None:
        self._forwards += 1

    def run(self, request: GenerationRequest, mp4_path: str | None = None) -> RunOutput:
        """One request; the reference always decodes in full (`mp4_path` is unused: the worker writes it)."""
        plan = plan_request(request, self.defaults)
        refs = [("image", plan.image), ("last_image", plan.last_image)]
        refs += [(f"reference{i}", r) for i, r in enumerate(plan.references)]
        images = {k: Image.open(r.path).convert("RGB") for k, r in refs if r is not None}
        durations: dict[str, float] = {}
        spans: list[tuple[str, float, float]] = []
        self._forwards = 0
        with timed_stages(durations, self.device, spans):
            state = self.pipes[plan.task](**reference_inputs(plan, images))
        durations["denoise_per_step"] = durations["denoise"] / max(1, self._forwards)
        video = np.asarray(state.get("videos")[0], dtype=np.float32)
        audio = state.get("audio")[0]
        audio = audio.float().cpu().numpy() if isinstance(audio, torch.Tensor) else np.asarray(audio, np.float32)
        return RunOutput(video, audio, durations, plan, stage_timeline=spans)

    def dits(self) -> list[tuple[nn.Module, H3TransformerConfig, ShapeOf]]:
        out = []
        for task in self.pipes:
            dit = self._dit(task)
            out.append((dit, H3TransformerConfig.from_dict(dict(dit.config)), _diffusers_shape))
        return out

    def close(self) -> None:
        self.pipes.clear()


RUNNERS = {"h3serve": H3Runner, "diffusers": DiffusersRunner}
