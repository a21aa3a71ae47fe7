"""The analytic DiT FLOP count against torch's own FLOP counter, and the hook-based counter."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from h3serve.model.layout import TEXT_TAG, build_keyframe_layout, patchify
from h3serve.model.transformer import H3Transformer, H3TransformerConfig
from h3serve.tools.bench.flops import FlopCounter, ForwardShape, forward_flops, text_embed_flops
from h3serve.tools.tiny.make_checkpoint import PRESETS

CFG = H3TransformerConfig.from_dict(dict(PRESETS["tiny"].transformer))


@pytest.fixture(scope="module")
def model_and_inputs():
    torch.manual_seed(0)
    model = H3Transformer(CFG).eval()
    text_rows, frames, lh, lw, audio = 7, 7, 4, 6, 20
    layout = build_keyframe_layout(torch.full((text_rows,), TEXT_TAG), frames, lh, lw, audio)
    video = patchify(torch.randn(1, CFG.in_channels, frames, lh, lw))[None]
    audio_rows = torch.randn(1, 2 * audio, CFG.audio_in_channels)
    timestep, row_index = layout.row_timesteps(0.7, 0.4)
    text_states = torch.randn(1, text_rows, CFG.text_dim)
    return model, (video, audio_rows, text_states, timestep, row_index, layout.packed)


def _torch_count(fn) -> int:
    # The math SDPA backend runs attention as bmm ops, which torch's counter sees (the fused CPU kernel it does not).
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter, torch.no_grad():
        fn()
    return counter.get_total_flops()


def test_forward_and_text_embedding_flops_match_torch_counter(model_and_inputs):
    model, (video, audio, text_states, timestep, row_index, packed) = model_and_inputs
    text = model.embed_text(text_states)
    shape = ForwardShape(video.shape[1], audio.shape[1], text.shape[1], timestep.numel())
    assert shape.timesteps == 2 and shape.seq_len == packed.seq_len
    counted = _torch_count(lambda: model(video, audio, text, timestep, row_index, packed))
    assert forward_flops(CFG, shape) == pytest.approx(counted, rel=1e-9)
    assert text_embed_flops(CFG, text.shape[1]) == pytest.approx(
        _torch_count(lambda: model.embed_text(text_states)), rel=1e-9
    )


def test_counter_sums_what_ran_through_hooks(model_and_inputs):
    model, (video, audio, text_states, timestep, row_index, packed) = model_and_inputs
    counter = FlopCounter()
    counter.attach(model, CFG, lambda args, kwargs: ForwardShape(
        args[0].shape[1], args[1].shape[1], args[2].shape[1], args[3].numel()
    ))
    with torch.no_grad():
        text = model.embed_text(text_states)
        for _ in range(3):
            model(video, audio, text, timestep, row_index, packed)
    shape = ForwardShape(video.shape[1], audio.shape[1], text.shape[1], 2)
    assert counter.forwards == 3 and counter.shapes == {shape}
    assert len(counter.forward_s) == 3 and all(t > 0 for t in counter.forward_s)
    assert counter.flops == pytest.approx(3 * forward_flops(CFG, shape) + text_embed_flops(CFG, text.shape[1]))
    counter.detach()
    with torch.no_grad():
        model(video, audio, text, timestep, row_index, packed)
    assert counter.forwards == 3  # detached: nothing more counted
