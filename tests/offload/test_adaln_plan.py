"""The AdaLN terms on the released DiT, on the meta device: the parameter split, and the planner's modulation
bytes against what the memo's pass really builds for a default 50-step schedule."""

from __future__ import annotations

import pytest
import torch

from h3serve.model.adaln_memo import ForwardTimes, compute_entries, no_scope
from h3serve.model.layout import TEXT_TAG, build_keyframe_layout
from h3serve.model.scheduler import FlowSchedule
from h3serve.model.step_times import step_times
from h3serve.model.transformer import H3Transformer, H3TransformerConfig
from h3serve.offload.activations import RequestShape
from h3serve.offload.adaln import modulation_bytes
from h3serve.offload.inventory import dit_bytes
from h3serve.rules import limits


def test_the_released_dit_is_39_percent_adaln():
    c = dit_bytes("transformer", H3TransformerConfig(), torch.bfloat16)
    assert c.params == 33_122_992_896 and c.adaln_params == 13_039_369_728  # 13.04 B of 33.12 B
    assert c.adaln_bytes == 2 * c.adaln_params  # bf16
    block = c.group("transformer_blocks").block_bytes[0]
    assert c.without_adaln().group("transformer_blocks").block_bytes[0] == block - c.adaln_blocks[0]
    assert c.without_adaln().total_bytes == c.total_bytes - c.adaln_bytes


def test_planned_modulation_bytes_bound_what_the_memo_builds():
    task, anchors = "fl2va", ("first",)  # keyframe rows: 4 kept table rows a step
    cfg = H3TransformerConfig()
    with torch.device("meta"):
        model = H3Transformer(cfg).to(torch.bfloat16)
    model.time_embedder.float()
    layout = build_keyframe_layout(torch.full((4,), TEXT_TAG), 2, 2, 2, 2, anchors)
    schedules = (FlowSchedule.shifted(limits.DEFAULT_STEPS, 12.0), FlowSchedule.shifted(limits.DEFAULT_STEPS, 3.0))
    times = step_times(schedules, layout, (None, None), torch.device("cpu"))
    forwards = [ForwardTimes(times.timesteps[i], times.row_index[i]) for i in range(len(times))]
    tags = layout.packed.token_tags
    with torch.inference_mode():
        entries = compute_entries(model, forwards, [f.slots(tags) for f in forwards], torch.device("meta"), no_scope)
    built = sum(e.nbytes for e in entries)
    planned = modulation_bytes(cfg, RequestShape(1344, 768, 124, task), 2)
    assert len(entries) == limits.DEFAULT_STEPS and 0.99 * planned < built <= planned
    assert planned == pytest.approx(648.3e6, rel=1e-3)  # docs/memory.md
    assert modulation_bytes(cfg, RequestShape(1344, 768, 124, "t2va"), 2) == pytest.approx(486.0e6, rel=1e-3)
