"""The selftest's vocabulary: a check's outcome, the context every check reads, the budget, the table."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from h3serve.model.transformer import H3TransformerConfig
from h3serve.tools.verdicts import CheckFailed, Skip

PASS, FAIL, SKIP = "pass", "fail", "skipped"
# CPU: a reduced width (the mechanisms, in seconds); CUDA: the released width, a few blocks.
CPU_DIT = H3TransformerConfig(
    num_attention_heads=2, attention_head_dim=32, hidden_size=64, num_layers=3, num_refiner_layers=1, ffn_dim=96,
    text_dim=32, freq_dim=32, time_embed_hidden_dim=64, time_embed_dim=32, rope_freq_dim=4,
)
GPU_DIT = H3TransformerConfig(num_layers=3, num_refiner_layers=1)


@dataclass
class Outcome:
    """One named check: pass / fail / skipped, a figure, and on failure what to do about it."""

    name: str
    status: str
    figure: str = ""
    message: str = ""  # fail: what is wrong and the fix; skipped: why it cannot apply here
    seconds: float = 0.0
    data: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class DemoRequest:
    """The end-to-end request on the shipped demo checkpoint, and `verdict(mp4)`: a figure of what the MP4 shows
    right, or `CheckFailed` naming what it does not (h3serve.entrypoints.selftest supplies both)."""

    request: Any  # a GenerationRequest
    verdict: Callable[[Path], str]


@dataclass
class SelftestContext:
    device: torch.device
    dtype: torch.dtype  # the compute dtype of the engine flags
    attention: dict[str, str]  # role -> backend of the engine flags
    compile: bool  # the engine flags compile the DiT
    model: object  # the checkpoint for the end-to-end request (Path)
    engine_config: object  # the EngineConfig of the engine flags
    budget_s: float
    # The planner's plan of the released H3 under these engine flags for GPUs of N bytes (`h3serve plan`).
    released_plan: Callable[[int], Any] | None = None
    demo: DemoRequest | None = None  # on the shipped demo checkpoint: its request, whose MP4 must show what it asks
    shared: dict = field(default_factory=dict)  # what several checks reuse (the end-to-end engine)
    started: float = field(default_factory=time.perf_counter)

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def dit(self) -> H3TransformerConfig:
        return GPU_DIT if self.cuda else CPU_DIT

    def shape(self) -> tuple[int, int, int]:
        """(width, height, frames) of the throughput forward: the released default canvas on a GPU."""
        return (1344, 768, 124) if self.cuda else (64, 64, 22)

    def numerics_shape(self) -> tuple[int, int, int]:
        """(width, height, frames) of the numerics and memory-path forwards: several latent frames, audio rows."""
        return (448, 256, 22) if self.cuda else (64, 64, 22)

    def left_s(self) -> float:
        return self.budget_s - (time.perf_counter() - self.started)


Check = Callable[[SelftestContext], tuple[str, dict] | str]


def run_check(name: str, check: Check, ctx: SelftestContext) -> Outcome:
    """Run one check: its figure on success, "skipped: why" when it cannot apply, the message on failure."""
    if ctx.left_s() <= 0:
        return Outcome(name, FAIL, message=f"not run: the budget of {ctx.budget_s:g} s is spent; raise --budget-s")
    start = time.perf_counter()
    try:
        got = check(ctx)
    except Skip as e:
        return Outcome(name, SKIP, message=str(e), seconds=time.perf_counter() - start)
    except CheckFailed as e:
        return Outcome(name, FAIL, message=str(e), seconds=time.perf_counter() - start)
    except Exception as e:  # a crash is a failure of that check, not of the selftest
        return Outcome(name, FAIL, message=f"{type(e).__name__}: {e}", seconds=time.perf_counter() - start)
    figure, data = (got, {}) if isinstance(got, str) else got
    return Outcome(name, PASS, figure=figure, seconds=time.perf_counter() - start, data=data)


def table(outcomes: list[Outcome]) -> str:
    """A readable table, then the one-line verdict."""
    width = max(len(o.name) for o in outcomes)
    lines = [f"{'check':<{width}}  {'result':<7}  {'time':>6}  figure / reason"]
    for o in outcomes:
        text = o.figure if o.status == PASS else o.message
        lines.append(f"{o.name:<{width}}  {o.status:<7}  {o.seconds:>5.1f}s  {text}")
    lines.append(verdict(outcomes))
    return "\n".join(lines)


def verdict(outcomes: list[Outcome]) -> str:
    failed = [o.name for o in outcomes if o.status == FAIL]
    passed = sum(o.status == PASS for o in outcomes)
    skipped = sum(o.status == SKIP for o in outcomes)
    if failed:
        return f"verdict: FAIL ({len(failed)} failed: {', '.join(failed)}; {passed} passed, {skipped} skipped)"
    return f"verdict: OK ({passed} passed, {skipped} skipped as not applicable here)"
