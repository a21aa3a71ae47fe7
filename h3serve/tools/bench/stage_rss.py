"""Per-stage resident set of a bench run: the pipeline's stage hooks tell the RSS sampler which stage is running.

The whole process' RSS is dominated by the weights, so a smaller decode hardly moves it; what a stage adds to the
RSS it started from shows its own working set. The decode and write span (`DECODE_WRITE`: the soundtrack and
video decode, and for the full decode the MP4 mux after it) is the one `--decode-mode stream` is meant to shrink.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from h3serve.rank.memory import RssSampler, StageRss

DECODE_WRITE = ("audio_decode", "video_decode", "mux")
MB = 2**20


class StageTee:
    """Wraps a pipeline's `StageHooks`: each `stage(name)` also runs inside `sampler.stage(name)`."""

    def __init__(self, inner: Any, sampler: RssSampler):
        self.inner = inner
        self.sampler = sampler

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        with self.sampler.stage(name), self.inner.stage(name):
            yield

    def __getattr__(self, name: str) -> Any:  # request(), weights() and the runtime's own attributes
        return getattr(self.inner, name)


@contextmanager
def sampling_stages(pipeline: Any, sampler: RssSampler) -> Iterator[None]:
    """For the duration: `pipeline`'s stages (None: a multi-rank engine, stages run elsewhere) feed `sampler`."""
    if pipeline is None:
        yield
        return
    hooks = pipeline.hooks
    pipeline.hooks = StageTee(hooks, sampler)
    try:
        yield
    finally:
        pipeline.hooks = hooks


def _mb(s: StageRss) -> dict[str, float]:
    return {"start_mb": s.start_bytes / MB, "peak_mb": s.peak_bytes / MB, "added_mb": s.added_bytes / MB}


def stage_record(sampler: RssSampler) -> dict[str, Any]:
    """The record's per-stage RSS and the decode-and-write span (None where no stage was seen)."""
    span = sampler.window(DECODE_WRITE)
    return {
        "stages": {name: _mb(s) for name, s in sampler.stages.items()},
        "decode_write": None if span is None else _mb(span),
    }
