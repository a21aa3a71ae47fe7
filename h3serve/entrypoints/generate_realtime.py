"""`h3serve generate --realtime-lora DIR --duration S`: a real-time session run offline into one MP4.

The same plan and the same chunks a streaming client of `WS /v1/realtime/video` receives (h3serve.rank.realtime_loop):
whole five-second requests, so the file holds at least S seconds (124 + 119·k frames), written chunk by chunk as
they are generated. One rank runs in this process; several run as rank processes behind the executor's session.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

from h3serve.config.engine_config import EngineConfig
from h3serve.engine.executor import Executor
from h3serve.engine.realtime_stream import RealtimeSpec
from h3serve.entrypoints.cli_util import EXIT_ERROR, fail
from h3serve.media.mp4 import EncoderOptions
from h3serve.media.sink import Mp4Chunks
from h3serve.rank.model_runner import ModelRunner
from h3serve.rank.realtime_loop import generate_offline
from h3serve.rules import limits
from h3serve.rules.defaults import ModelDefaults
from h3serve.rules.realtime_geometry import CHUNKS_PER_REQUEST, session_frames
from h3serve.rules.validate.realtime_plan import RealtimePlan, plan_realtime

# generate's flags a session has no use for (each refused with its name when given)
_NOT_REALTIME = ("aspect_ratio", "short_edge", "long_video", "long_video_mode", "window_frames", "overlap_frames",
                 "continuation_prompt", "control_mask", "control_source", "control_scale", "source_video",
                 "source_audio", "video_noise_mask", "audio_noise_mask", "audio_mode", "start_time", "extend",
                 "save_raw")


def realtime_plan(args: argparse.Namespace, defaults: ModelDefaults) -> RealtimePlan:
    """The session the flags ask for (`RequestError`/`ValueError` naming what is wrong)."""
    given = [name for name in _NOT_REALTIME if getattr(args, name, None) not in (None, False)]
    if given:
        raise ValueError(f"--{given[0].replace('_', '-')} does not apply to a real-time session (--realtime-lora)")
    duration = limits.DEFAULT_DURATION_S if args.duration is None else args.duration
    seconds = limits.MAX_REALTIME_FRAMES / limits.FPS
    if not math.isfinite(duration) or not 0 < duration <= seconds:
        raise ValueError(f"--duration: a real-time session lasts more than 0 and at most {seconds:g} s")
    extra = {"task": args.task, "image": args.image, "last_image": args.last_image, "references": args.references,
             "num_outputs_per_prompt": args.num_outputs, "num_inference_steps": args.steps,
             "flow_shift": args.flow_shift, "audio_flow_shift": args.audio_flow_shift,
             "sample_solver": args.sample_solver, "lora": args.lora, "control": args.control}
    width = limits.REALTIME_DEFAULT_SIZE[0] if args.width is None else args.width
    height = limits.REALTIME_DEFAULT_SIZE[1] if args.height is None else args.height
    seed = limits.DEFAULT_SEED if args.seed is None else args.seed
    frames = max(1, round(duration * limits.FPS))
    return plan_realtime(args.prompt, width, height, seed, frames, extra=extra, defaults=defaults)


class _Progress:
    """The MP4 writer behind a one-line progress report per chunk."""

    def __init__(self, writer: Mp4Chunks, chunks: int):
        self.writer, self.chunks, self.done, self.start = writer, chunks, 0, time.perf_counter()

    def segment(self, frames, audio) -> bytes:
        self.writer.segment(frames, audio)
        self.done += 1
        print(f"\rchunk {self.done}/{self.chunks} ({time.perf_counter() - self.start:.1f} s)", end="",
              file=sys.stderr, flush=True)
        return b""

    def finish(self) -> bytes:
        print(file=sys.stderr)
        return self.writer.finish()


def generate_realtime(args: argparse.Namespace, config: EngineConfig, defaults: ModelDefaults,
                      options: EncoderOptions) -> int:
    """Plan, run and write the session; the exit code."""
    try:
        plan = realtime_plan(args, defaults)
    except ValueError as e:
        return fail(str(e))
    frames = session_frames(plan.chunks)
    print(f"{plan.width}x{plan.height}, {frames} frames ({frames / limits.FPS:.3f} s) in {plan.chunks} chunks "
          f"({plan.chunks // CHUNKS_PER_REQUEST} requests), seed {plan.seed}, model {config.model}", file=sys.stderr)
    try:
        writer = _Progress(Mp4Chunks(args.output, frames, plan.width, plan.height, options), plan.chunks)
    except (ValueError, OSError) as e:
        return fail(f"writing the output failed: {e}", EXIT_ERROR)
    try:
        if config.world_size > 1:
            _run_ranks(config, plan, writer)  # the stream finishes the writer with its trailer
        else:
            generate_offline(ModelRunner(config), plan, writer)
            writer.finish()
    except Exception as e:  # one line, never a traceback: the session was valid, the run failed
        writer.writer.abort()
        return fail(f"generation failed: {type(e).__name__}: {e}", EXIT_ERROR)
    print(Path(args.output).resolve())
    return 0


def _run_ranks(config: EngineConfig, plan: RealtimePlan, writer: _Progress) -> None:
    """The session through the executor's rank processes (the writer takes the chunks' media as they come)."""
    executor = Executor(config)
    try:
        spec = RealtimeSpec(plan.prompt, plan.width, plan.height, plan.seed, plan.num_frames)
        stream = executor.open_realtime(spec, writer_factory=lambda width, height: writer)
        while stream.next_chunk(timeout_s=float(config.init_timeout_s)) is not None:
            pass
    finally:
        executor.close()
