"""Regional / full torch.compile of the DiT: same outputs as eager, one graph for every shape, eager fallback."""

from __future__ import annotations

import pytest
import torch
from small_dit import SMALL_DIT, random_small_dit

from h3serve.accel.compile import CompileState, compile_transformer
from h3serve.model.layout import TEXT_TAG, build_keyframe_layout, patchify
from h3serve.model.transformer import H3Transformer

_model = random_small_dit


def _run(model: H3Transformer, frames: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    text_len, lh, lw, audio = 7, 2, 4, 3 * frames
    layout = build_keyframe_layout(torch.full((text_len,), TEXT_TAG), frames, lh, lw, audio, anchors=("first",))
    video = patchify(torch.randn(1, 24, frames + 1, lh, lw, generator=g))[None]
    audio_rows = torch.randn(1, 2 * audio, 32, generator=g)
    text = torch.randn(1, text_len, SMALL_DIT["text_dim"], generator=g)
    timestep, row_index = layout.row_timesteps(0.3, 0.6)
    with torch.inference_mode():
        return model(video, audio_rows, model.embed_text(text), timestep, row_index, layout.packed)


@pytest.mark.slow
@pytest.mark.parametrize("granularity", ["regional", "full"])
def test_compiled_equals_eager_across_shapes_without_recompiling(granularity):
    torch._dynamo.reset()
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
