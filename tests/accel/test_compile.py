"""Regional / full torch.compile of the DiT: same outputs as eager, one graph for every shape, eager fallback."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from small_dit import random_small_dit, small_dit_inputs
from torch import nn

from h3serve.accel.compile import CompileFailedMidCall, CompileState, compile_transformer
from h3serve.model.transformer import H3Transformer
from h3serve.parallel.comm import all_reduce_

_model = random_small_dit


def _run(model: H3Transformer, frames: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    video, audio_rows, text, timestep, row_index, packed = small_dit_inputs(frames, seed)
    with torch.inference_mode():
        return model(video, audio_rows, model.embed_text(text), timestep, row_index, packed)


@pytest.mark.slow
@pytest.mark.parametrize("granularity", ["regional", "full"])
def test_compiled_equals_eager_across_shapes_without_recompiling(granularity):
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()  # process-wide: graphs an earlier test of this worker compiled count there
    eager, compiled = _model(), _model()
    lines: list[str] = []
    compile_transformer(compiled, granularity, True, CompileState(log=lines.append))
    graphs = []
    for frames in (5, 7, 9):  # three request shapes: dynamic shapes keep the first shape's graphs
        for ours, theirs in zip(_run(compiled, frames), _run(eager, frames), strict=True):
            assert (ours - theirs).abs().max() <= 1e-4
        graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    assert lines == []
    # regional: one graph for the (identical) main blocks, one for the refiner block
    assert graphs[0] == graphs[-1] and (granularity == "full" or graphs[0] == 2)


def test_a_compile_failure_falls_back_to_eager_with_one_warning():
    def broken_backend(gm, example_inputs):
        raise RuntimeError("no compiler here\nsecond line")

    torch._dynamo.reset()
    eager, compiled = _model(), _model()
    lines: list[str] = []
    compile_transformer(compiled, "regional", True, CompileState(log=lines.append), backend=broken_backend)
    for frames in (5, 7):
        for ours, theirs in zip(_run(compiled, frames), _run(eager, frames), strict=True):
            assert torch.equal(ours, theirs)
    assert len(lines) == 1 and "no compiler here" in lines[0] and "running the DiT eagerly" in lines[0]
    assert all("second line" not in line for line in lines)


class _TpBlock(nn.Module):
    """A block with a tensor-parallel all-reduce between two linears: a compiled call graph-breaks there."""

    def __init__(self, group: object):
        super().__init__()
        self.group = group
        self.first, self.second = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(all_reduce_(self.first(x), self.group)).relu()


def _dit_of(block: nn.Module) -> nn.Module:
    dit = nn.Module()
    dit.transformer_blocks = nn.ModuleList([block])
    dit.token_refiner = nn.Module()
    dit.token_refiner.refiner_blocks = nn.ModuleList()
    return dit


def _fail_on_graph(n: int):
    """A backend whose n-th graph (1-based) fails to compile; the others run as traced."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        if len(graphs) == n:
            raise RuntimeError(f"graph {n} does not compile")
        return gm.forward

    return backend


def test_a_compile_failure_past_a_collective_fails_instead_of_re_running_it(monkeypatch):
    """Defect 9 of issue 29: the graph after the all-reduce compiles only once the all-reduce ran; its failure
    used to re-run the whole block eagerly, so this rank issued the all-reduce twice while its peers, compiled
    fine, had moved on: the collective sequences diverged. Now the call fails (the job fails, the ranks restart)."""
    issued: list[torch.Tensor] = []
    monkeypatch.setattr(dist, "all_reduce", lambda x, group=None, **kwargs: issued.append(x))
    torch._dynamo.reset()
    block = _TpBlock(group=object())
    lines: list[str] = []
    compile_transformer(_dit_of(block), "regional", True, CompileState(log=lines.append), backend=_fail_on_graph(2))
    with pytest.raises(CompileFailedMidCall, match="1 collective"):
        block(torch.randn(3, 8))
    assert len(issued) == 1  # the one all-reduce the peers pair it with, never a second
    assert len(lines) == 1 and "graph 2 does not compile" in lines[0]
    block(torch.randn(3, 8))  # the next call (a later job on this process) runs eagerly
    assert len(issued) == 2


def test_a_compile_failure_before_any_collective_still_falls_back(monkeypatch):
    issued: list[torch.Tensor] = []
    monkeypatch.setattr(dist, "all_reduce", lambda x, group=None, **kwargs: issued.append(x))
    torch._dynamo.reset()
    block = _TpBlock(group=object())
    expected = _TpBlock(group=object())
    expected.load_state_dict(block.state_dict())
    state = CompileState(log=lambda line: None)
    compile_transformer(_dit_of(block), "regional", True, state, backend=_fail_on_graph(1))
    x = torch.randn(3, 8)
    assert torch.equal(block(x), expected(x))
    assert len(issued) == 2  # one per call: the failed compiled attempt issued none
