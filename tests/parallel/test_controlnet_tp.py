"""The ControlNet branch under DiT tensor parallelism: the branch runs whole on every rank (its blocks are never
cut) on the replicated residual stream, so the TP2 DiT with control equals the one-rank DiT with control, for each
part of the 196 columns in use (a control video only; a mask, a source and a control video)."""

from __future__ import annotations

import json

import pytest
import torch
from rank_harness import run_ranks
from safetensors.torch import save_file
from small_dit import random_small_dit

from h3serve.loading.components import load_transformer
from h3serve.loading.controlnet_weights import read_controlnet
from h3serve.model.controlnet import ControlInput
from h3serve.model.layout import TEXT_TAG, build_keyframe_layout, patchify
from h3serve.model.transformer import H3Transformer
from h3serve.tools.tiny.make_adapter import write_controlnet


def _inputs(text_dim: int):
    g = torch.Generator().manual_seed(1)
    frames, text_len, lh, lw = 3, 7, 2, 4
    layout = build_keyframe_layout(torch.full((text_len,), TEXT_TAG), frames, lh, lw, 3 * frames, anchors=())
    video = patchify(torch.randn(1, 24, frames, lh, lw, generator=g))[None]
    audio = torch.randn(1, 6 * frames, 32, generator=g)
    text = torch.randn(1, text_len, text_dim, generator=g)
    timestep, row_index = layout.row_timesteps(0.3, 0.6)
    control_only = torch.randn(1, video.shape[1], 196, generator=g)
    control_only[..., 96:] = 0
    full = torch.randn(1, video.shape[1], 196, generator=g)
    return video, audio, text, timestep, row_index, layout.packed, (control_only, full)


def _outputs(dit: H3Transformer, control_file: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    dit.fuse_projections()
    dit.controlnet = read_controlnet(control_file, dit.config, torch.device("cpu"), torch.float32)
    video, audio, text, timestep, row_index, packed, rows = _inputs(dit.config.text_dim)
    with torch.inference_mode():
        states = dit.embed_text(text)
        return [dit(video, audio, states, timestep, row_index, packed, control=ControlInput(r, 0.7)) for r in rows]


def _tp_rank(rank: int, world: int, folder: str, control_file: str):
    import torch.distributed as dist

    from h3serve.parallel.tensor_parallel import TensorParallel

    tp = TensorParallel(rank, world, dist.group.WORLD, H3Transformer.tensor_parallel_plan)
    return _outputs(load_transformer(folder, tp=tp), control_file)


@pytest.mark.slow
def test_tp2_with_control_equals_one_rank(tmp_path):
    base = random_small_dit()
    folder = tmp_path / "transformer"
    folder.mkdir()
    weights = {k: v.contiguous() for k, v in base.state_dict().items()}
    save_file(weights, str(folder / "diffusion_pytorch_model.safetensors"))
    config = dict(vars(base.config))
    (folder / "config.json").write_text(json.dumps(config))
    control = write_controlnet(tmp_path / "control", config, blocks=2, seed=3, std=0.2)
    one_rank = _outputs(load_transformer(folder), str(control))
    for outputs in run_ranks(2, _tp_rank, str(folder), str(control)):
        for ours, theirs in zip(outputs, one_rank, strict=True):
            for mine, ref in zip(ours, theirs, strict=True):
                assert (mine - ref).abs().max() <= 1e-5
    assert (one_rank[0][0] - one_rank[1][0]).abs().max() > 1e-3  # the mask and source columns count
