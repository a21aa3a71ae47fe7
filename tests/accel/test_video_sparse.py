"""Video sparse attention (FastVideo's VSA) on the packed sequence: the tiles, dense attention exactly at full
top-k, the reference against the test's own brute force at partial top-k, and the FlexAttention block-sparse path
against the reference (eager on CPU in float32; compiled in bfloat16 on a GPU)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from h3serve.accel.video_sparse import (
    TILE_ROWS,
    dense_reference,
    tile_plan,
    topk_tiles,
    vsa_flex,
    vsa_reference,
)

PREFIX, GRID = 70, (5, 6, 9)  # 70 text/condition/audio rows, then a 5 x 6 x 9 latent video: partial tiles everywhere
SEQ = PREFIX + 5 * 6 * 9


def _qkv(seed: int = 0, heads: int = 2, dim: int = 16, batch: int = 1, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, SEQ, heads, dim, generator=g).to(dtype) for _ in range(4)]  # q, k, v, gate


def test_tiles_are_runs_of_64_then_4x4x4_cubes_of_the_target_video():
    plan = tile_plan(SEQ, GRID)
    valid = plan.slots[plan.slots >= 0]
    assert sorted(valid.tolist()) == list(range(SEQ))  # every row exactly once
    assert plan.num_tiles == 2 + 2 * 2 * 3 and plan.sizes.tolist()[:2] == [64, 6]
    assert torch.equal(plan.slots[0], torch.arange(64))  # the prefix in packed order
    for tile, size in enumerate(plan.sizes.tolist()):
        rows = plan.slots[tile]
        assert (rows[:size] >= 0).all() and (rows[size:] < 0).all()  # valid rows first
        assert (plan.tile_of_row[rows[:size]] == tile).all()
        if tile >= 2:  # one cube: frames, rows and columns in one 4-wide bucket each
            f, r, c = ((rows[:size] - PREFIX) // 54, (rows[:size] - PREFIX) // 9 % 6, (rows[:size] - PREFIX) % 9)
            assert all(len(set((axis // 4).tolist())) == 1 for axis in (f, r, c))
    assert plan.sizes[2:].tolist()[:3] == [64, 64, 16]  # cube (0, 0, 2) holds 4 x 4 x 1 rows
    assert topk_tiles(14) == 3 and topk_tiles(14, fixed=64) == 14 and topk_tiles(1, 0.99) == 1


def test_full_top_k_is_dense_attention_exactly():
    q, k, v, gate = _qkv()
    plan = tile_plan(SEQ, GRID)
    dense = dense_reference(q, k, v)
    assert torch.equal(vsa_reference(q, k, v, plan, plan.num_tiles), dense)  # no gate: the fine branch alone
    assert torch.equal(vsa_reference(q, k, v, plan, plan.num_tiles, torch.zeros_like(gate)), dense)
    sdpa = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v))).transpose(1, 2)
    assert (dense - sdpa).abs().max() < 1e-5  # and that is attention
    assert not torch.allclose(vsa_reference(q, k, v, plan, 3), dense, atol=1e-3)  # sparse is not


def _brute_force(q, k, v, gate, topk):
    """The test's own VSA, row by row, from its own tile assignment (not the module's `TilePlan`)."""
    tile = torch.empty(SEQ, dtype=torch.long)
    tile[:PREFIX] = torch.arange(PREFIX) // TILE_ROWS
    f, r, c = torch.meshgrid(*(torch.arange(n) for n in GRID), indexing="ij")
    cube = ((f // 4) * 2 + r // 4) * 3 + c // 4  # 2 x 2 x 3 cubes, cube-major
    tile[PREFIX:] = 2 + cube.flatten()
    tiles = int(tile.max()) + 1
    out = torch.empty(q.shape[0], SEQ, q.shape[2], q.shape[3])
    scale = q.shape[-1] ** -0.5
    for b in range(q.shape[0]):
        for h in range(q.shape[2]):
            qh, kh, vh = (t[b, :, h].double() for t in (q, k, v))
            means = [torch.stack([x[tile == i].mean(0) for i in range(tiles)]) for x in (qh, kh, vh)]
            probs = torch.softmax(means[0] @ means[1].T * scale, dim=-1)
            coarse = probs @ means[2]
            keep = probs.topk(topk, dim=-1).indices
            for i in range(SEQ):
                allowed = torch.isin(tile, keep[tile[i]])
                weights = torch.softmax(qh[i] @ kh[allowed].T * scale, dim=-1)
                out[b, i, h] = (weights @ vh[allowed] + gate[b, i, h].double() * coarse[tile[i]]).float()
    return out


def test_partial_top_k_matches_the_brute_force():
    q, k, v, gate = _qkv(seed=1, batch=2)
    plan = tile_plan(SEQ, GRID)
    mine = vsa_reference(q, k, v, plan, 5, gate)
    assert (mine - _brute_force(q, k, v, gate, 5)).abs().max() < 1e-5


def test_the_flex_block_mask_path_equals_the_reference():
    q, k, v, gate = _qkv(seed=2)
    plan = tile_plan(SEQ, GRID)
    for topk in (1, 5, plan.num_tiles):
        reference = vsa_reference(q, k, v, plan, topk, gate)
        assert (vsa_flex(q, k, v, plan, topk, gate) - reference).abs().max() < 1e-5, topk


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the compiled block-sparse kernel needs a CUDA GPU")
def test_the_compiled_block_sparse_kernel_equals_the_reference_within_bf16_rounding():
    q, k, v, gate = (t.cuda() for t in _qkv(seed=3, heads=4, dim=64, dtype=torch.bfloat16))
    plan = tile_plan(SEQ, GRID).to(torch.device("cuda"))
    reference = vsa_reference(q, k, v, plan, 4, gate).float()
    flex = vsa_flex(q, k, v, plan, 4, gate).float()
    # bf16 keeps 8 significant bits: the fine branch's inputs and output round at 2^-8 relative.
    assert (flex - reference).abs().max() <= 2**-7 * reference.abs().max()


def _dit_inputs(seed: int = 1):
    """A FL2VA packed sequence of the small DiT: 7 text rows, 2 keyframes, 24 audio rows, a 9 x 4 x 6 target."""
    from h3serve.model.layout import TEXT_TAG, build_keyframe_layout, patchify

    g = torch.Generator().manual_seed(seed)
    text_len, frames, lh, lw, audio = 7, 9, 8, 12, 12
    layout = build_keyframe_layout(torch.full((text_len,), TEXT_TAG), frames, lh, lw, audio, anchors=("first", "last"))
    video = patchify(torch.randn(1, 24, frames + 2, lh, lw, generator=g))[None]
    audio_rows = torch.randn(1, 2 * audio, 32, generator=g)
    text = torch.randn(1, text_len, 32, generator=g)
    timestep, row_index = layout.row_timesteps(0.3, 0.6)
    return video, audio_rows, text, timestep, row_index, layout.packed


@torch.no_grad()
def test_a_gated_dit_on_vsa_in_row_chunks_and_at_full_top_k():
    from small_dit import random_small_dit

    from h3serve.accel import attention
    from h3serve.accel.video_sparse import SparseSettings

    video, audio, text, timestep, row_index, layout = _dit_inputs()
    assert layout.target_grid == (9, 4, 6)
    dense = random_small_dit()
    inputs = (video, audio, dense.embed_text(text), timestep, row_index, layout)
    expected = dense(*inputs)
    gated = random_small_dit()
    gated.add_sparse_gates(bias=True)
    for block in gated.transformer_blocks:
        torch.nn.init.zeros_(block.attn.to_gate_compress.weight)
        torch.nn.init.zeros_(block.attn.to_gate_compress.bias)
    roles = {"self": "FASTVIDEO_VSA", "minimax_h3.token_refiner": "TORCH_SDPA"}
    attention.install(gated, roles, SparseSettings(topk=10**6))  # every tile: dense, the gate adds 0
    for got, want in zip(gated(*inputs), expected, strict=True):
        assert (got - want).abs().max() < 1e-5
    with pytest.raises(attention.AttentionBackendError, match="carry video sparse attention gates"):
        attention.install(gated, dict.fromkeys(attention.ROLES, "TORCH_SDPA"))
    # A sparse, gated run is the same in row chunks (the gate is per row, computed chunk by chunk).
    for block in gated.transformer_blocks:
        torch.nn.init.normal_(block.attn.to_gate_compress.weight, std=0.2)
    attention.install(gated, roles, SparseSettings(sparsity=0.8))
    whole = gated(*inputs)
    assert gated.sparse_attention.topk == 2 and not torch.allclose(whole[0], expected[0], atol=1e-3)
    for block in gated.transformer_blocks:
        block.row_chunk = 100
    chunked = gated(*inputs)
    for got, want in zip(chunked, whole, strict=True):
        assert (got - want).abs().max() < 1e-5
