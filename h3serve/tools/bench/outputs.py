"""`h3serve bench --outputs N`: N outputs of one prompt denoised as one DiT batch against the same N one after
another (each exactly a separate request: its own text encode, noise, denoise and decode), in one engine, on the
device the engine picks. The two ways alternate over several rounds and the median round counts; every output must
be the same bits both ways (checked: the batch is only a speed-up).

Cost model: a denoise step of a batch of B costs about one step of one request when the device is not yet busy
with one (a GPU at a small canvas: the batch fills it), and B steps when it is (a CPU, or a GPU at the released
canvas, where one request's 10^4+ rows already fill it): the batch saves the per-step fixed costs (kernel launches,
AdaLN tables, weight streaming under offload) once per step instead of B times, and the text encode once per batch.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from h3serve.config.engine_config import EngineConfig
from h3serve.messages import GenerationOutput
from h3serve.rank.model_runner import ModelRunner
from h3serve.rules.request import GenerationRequest

PROMPT = "A red fox trots through fresh snow at dawn."


@dataclass(frozen=True)
class OutputsTiming:
    batch: int  # outputs per DiT batch (1: one after another)
    outputs: int
    seconds: float  # the median round: the whole request, encode to decoded arrays
    denoise_s: float  # its denoise stage

    @property
    def outputs_per_minute(self) -> float:
        return 60.0 * self.outputs / self.seconds


def _arrays(output: GenerationOutput) -> list[tuple[np.ndarray, np.ndarray]]:
    return [(media.video, media.audio) for media in output.outputs]


def measure_outputs(
    model: Path, outputs: int, steps: int, threads: int, rounds: int, log: Callable[[str], None],
    size: tuple[int, int] = (128, 64), duration_s: float = 4.0,
) -> tuple[list[OutputsTiming], str]:
    """([one after another, one batch], the device): each the median of `rounds` alternating rounds after one
    warm-up each. Raises if the two ways give different bits for any output."""
    engine = ModelRunner(EngineConfig(model=model, threads=threads, decode_mode="full", max_output_batch=outputs))
    request = GenerationRequest(prompt=PROMPT, width=size[0], height=size[1], duration_s=duration_s, steps=steps,
                                seed=0, num_outputs=outputs)
    plan = engine.plan(request)
    times: dict[int, list[tuple[float, float]]] = {1: [], outputs: []}
    results: dict[int, list[tuple[np.ndarray, np.ndarray]]] = {}
    for round_ in range(rounds + 1):  # round 0 warms up
        for batch in times:
            engine.config = dataclasses.replace(engine.config, max_output_batch=batch)  # what the engine batches
            start = time.perf_counter()
            output = engine.generate(dataclasses.replace(plan))
            seconds = time.perf_counter() - start
            if round_:
                times[batch].append((seconds, output.stage_durations.get("denoise", 0.0)))
                log(f"round {round_}: {outputs} outputs, batch {batch}: {seconds:.2f} s")
            results[batch] = _arrays(output)
    for (v1, a1), (vb, ab) in zip(results[1], results[outputs], strict=True):
        if not (np.array_equal(v1, vb) and np.array_equal(a1, ab)):
            raise RuntimeError("the batched outputs differ from the one-by-one outputs on this device")
    timings = [
        OutputsTiming(batch, outputs, statistics.median(t for t, _ in runs), statistics.median(d for _, d in runs))
        for batch, runs in times.items()
    ]
    return timings, str(engine.device)


def summary(results: list[OutputsTiming], steps: int, device: str) -> str:
    """A Markdown table: one row per way, the speed-up over one after another."""
    base = results[0].outputs_per_minute
    lines = [
        f"| outputs | per DiT batch | seconds (median) | denoise s | outputs/min | speed-up |  (128x64, 4 s, {steps} "
        f"steps, {device}; the same bits both ways)",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(f"| {r.outputs} | {r.batch} | {r.seconds:.2f} | {r.denoise_s:.2f} | {r.outputs_per_minute:.1f} "
                     f"| {r.outputs_per_minute / base:.2f}x |")
    return "\n".join(lines)
