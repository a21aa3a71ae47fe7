"""A stand-in for `h3serve.engine.executor.Executor` that needs no model: tests of the job queue and the HTTP
layer run in milliseconds per job, with the executor's contract (one job at a time, progress per step,
cancellation at the next step, `EngineError` on failure, `close` failing the job in flight) and small
deterministic outputs. Some prompts make a job fail in a given way (see `FAILURES`)."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable

import numpy as np

from h3serve.engine.executor import Cancelled, EngineError
from h3serve.messages import GenerationOutput
from h3serve.rules import geometry, limits
from h3serve.rules.names import TASKS
from h3serve.rules.validate import GenerationPlan, ModelDefaults

TINY_DEFAULTS = ModelDefaults(canvas_short_edge=64, canvas_max_pixels=64 * 128)
FAIL_PROMPT = "please fail"  # a rank raised: EngineError
CLIENT_FAIL_PROMPT = "please reject my media"  # a rank found the request at fault: EngineError(client_error=True)
TIMEOUT_PROMPT = "please time out"  # the engine did not answer: TimeoutError
CRASH_PROMPT = "please crash"  # a bug in the executor itself: RuntimeError
FAILURES: dict[str, Callable[[], Exception]] = {
    FAIL_PROMPT: lambda: EngineError("generation failed: RuntimeError: the fake engine was asked to fail"),
    CLIENT_FAIL_PROMPT: lambda: EngineError("references[0] ('x.png'): not a recognised image", client_error=True),
    TIMEOUT_PROMPT: lambda: TimeoutError("the engine did not answer in time"),
    CRASH_PROMPT: lambda: RuntimeError("/secret/path/spool.npz: something broke"),
}


def fake_video(plan: GenerationPlan) -> np.ndarray:
    """Smooth, seed-dependent frames (cheap to encode), [T, H, W, 3] float32 in [0, 1]."""
    t = np.linspace(0, 1, plan.num_frames, dtype=np.float32)[:, None, None, None]
    x = np.linspace(0, 1, plan.width, dtype=np.float32)[None, None, :, None]
    rgb = np.array([0.2, 0.5, 0.8], dtype=np.float32)[None, None, None, :]
    return np.broadcast_to((t * 0.5 + x * 0.3 + rgb + plan.seed * 0.01) % 1.0,
                           (plan.num_frames, plan.height, plan.width, 3)).copy()


def fake_audio(plan: GenerationPlan) -> np.ndarray:
    samples = geometry.audio_latents(plan.num_frames) * (limits.AUDIO_SAMPLE_RATE // limits.AUDIO_LATENTS_PER_SECOND)
    tone = 0.1 * np.sin(2 * np.pi * 440 * np.arange(samples, dtype=np.float32) / limits.AUDIO_SAMPLE_RATE)
    return np.stack([tone, tone]).astype(np.float32)


class FakeExecutor:
    """`ignore_cancel`: steps never notice `cancel` (as a step longer than the close timeout would not);
    only `close` stops such a job."""

    def __init__(self, step_s: float = 0.01, tasks: tuple[str, ...] = TASKS, ignore_cancel: bool = False,
                 controlnet: bool = True):
        self.step_s = step_s
        self.defaults = dataclasses.replace(TINY_DEFAULTS, controlnet=controlnet)  # serves every task and control
        self.tasks = tasks
        self.ignore_cancel = ignore_cancel
        self.plans: list[GenerationPlan] = []  # every plan started, in order
        self.cancelled_at: list[tuple[int, int]] = []  # (step, total) where a job stopped
        self.closed = False
        self._lock = threading.Lock()
        self._seq = 0
        self._cancel = 0

    def generate(self, plan, on_progress=None, on_start=None, timeout_s=None, encoder=None) -> GenerationOutput:
        with self._lock:
            self._seq += 1
            seq = self._seq
            if on_start is not None:
                on_start(seq)
            self.plans.append(plan)
            total = plan.progress_forwards  # forwards of every window and output, as the real pipeline reports them
            started = time.monotonic()
            for done in range(1, total + 1):
                time.sleep(self.step_s)
                if timeout_s is not None and time.monotonic() - started > timeout_s:  # stopped at this step
                    self.cancelled_at.append((done, total))
                    raise TimeoutError(f"generation timed out after {timeout_s:g}s")
                if on_progress is not None:
                    on_progress(done, total)
                if self.closed:  # as `Executor.close` killing the ranks under a running job
                    raise EngineError("rank 0 exited with code -9 while the request was running")
                if self._cancel == seq and not self.ignore_cancel:
                    self.cancelled_at.append((done, total))
                    raise Cancelled(f"job {seq} was cancelled")
            if plan.prompt in FAILURES:
                raise FAILURES[plan.prompt]()
            outputs = [plan.output(i) for i in range(plan.num_outputs)]
            first, *others = (GenerationOutput(fake_video(p), fake_audio(p)) for p in outputs)
            first.stage_durations, first.peak_memory_mb = {"denoise": total * self.step_s}, 12.5
            first.stage_timeline = [("denoise", started, time.monotonic())]  # the engine's spans: the host's clock
            first.others = others
            return first

    def cancel(self, seq: int) -> None:
        self._cancel = seq

    def alive(self) -> bool:
        return not self.closed

    def close(self) -> None:
        self.closed = True
