"""Our DiT against diffusers' MiniMaxH3Transformer3DModel: keys, shapes, state-dict round trips, forward."""

from __future__ import annotations

import pytest
import torch
from diffusers import MiniMaxH3Transformer3DModel
from small_dit import SMALL_DIT

from h3serve.checkpoint import native_names
from h3serve.loading import dit_keys as keys
from h3serve.model.layout import TEXT_TAG, build_keyframe_layout, patchify
from h3serve.model.transformer import H3Transformer, H3TransformerConfig, row_spans


@pytest.fixture(scope="module")
def reference() -> MiniMaxH3Transformer3DModel:
    torch.manual_seed(0)
    model = MiniMaxH3Transformer3DModel(**SMALL_DIT).eval()
    with torch.no_grad():  # diffusers zero-inits nothing here, but make every weight non-trivial anyway
        for p in model.parameters():
            p.normal_(0, 0.2)
    return model


@pytest.fixture(scope="module")
def ours(reference) -> H3Transformer:
    model = H3Transformer(H3TransformerConfig(**SMALL_DIT)).eval()
    model.load_state_dict(reference.state_dict(), strict=True)
    return model


def test_keys_and_shapes_equal_diffusers(reference, ours):
    ref = {k: tuple(v.shape) for k, v in reference.state_dict().items()}
    mine = {k: tuple(v.shape) for k, v in ours.state_dict().items()}
    assert mine == ref


def test_full_size_keys_and_shapes_equal_diffusers():
    with torch.device("meta"):
        ref = MiniMaxH3Transformer3DModel()
        mine = H3Transformer(H3TransformerConfig())
    ref_shapes = {k: tuple(v.shape) for k, v in ref.state_dict().items()}
    assert {k: tuple(v.shape) for k, v in mine.state_dict().items()} == ref_shapes
    assert len(ref_shapes) == 638
    assert sum(v.numel() for v in mine.parameters()) == 33_122_992_896


def test_full_size_fused_projections_keep_every_weight():
    """The released width on the meta device: fusing Q/K/V changes no parameter count, only the layout."""
    with torch.device("meta"):
        model = H3Transformer(H3TransformerConfig())
    model.fuse_projections()
    assert sum(v.numel() for v in model.parameters()) == 33_122_992_896
    assert tuple(model.transformer_blocks[0].attn.to_qkv.weight.shape) == (3 * 56 * 128, 5376)
    assert all(b.attn.to_qkv is not None for b in [*model.transformer_blocks, *model.token_refiner.refiner_blocks])


def test_state_dict_round_trip_both_ways(reference, ours):
    back = MiniMaxH3Transformer3DModel(**SMALL_DIT)
    back.load_state_dict(ours.state_dict(), strict=True)
    for k, v in reference.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k


def _inputs(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    text_len, frames, lh, lw, audio = 7, 7, 2, 4, 12
    layout = build_keyframe_layout(torch.full((text_len,), TEXT_TAG), frames, lh, lw, audio, anchors=("first", "last"))
    video = patchify(torch.randn(1, 24, frames + 2, lh, lw, generator=g))[None]
    audio_rows = torch.randn(1, 2 * audio, 32, generator=g)
    text = torch.randn(1, text_len, SMALL_DIT["text_dim"], generator=g)
    timestep, row_index = layout.row_timesteps(0.3, 0.6)
    return layout, video, audio_rows, text, timestep, row_index


def test_forward_matches_diffusers(reference, ours):
    layout, video, audio, text, timestep, row_index = _inputs()
    p = layout.packed
    with torch.no_grad():
        ref_v, ref_a = reference(
            hidden_states=video,
            audio_hidden_states=audio,
            encoder_hidden_states=text,
            timestep=timestep,
            timestep_indices=row_index,
            token_tags=p.token_tags,
            position_ids=p.position_ids,
            video_indices=p.video_indices,
            audio_indices=p.audio_indices,
            text_indices=p.text_indices,
            return_dict=False,
        )
        v, a = ours(video, audio, ours.embed_text(text), timestep, row_index, p)
    assert v.shape == ref_v.shape and a.shape == ref_a.shape
    assert (v - ref_v).abs().max() < 1e-5
    assert (a - ref_a).abs().max() < 1e-5
    assert timestep.numel() == 3  # video 0.3, condition 0.999, audio 0.6


def test_fused_qkv_projections_keep_the_output_bit_identical(reference, ours):
    layout, video, audio, text, timestep, row_index = _inputs()
    fused = H3Transformer(H3TransformerConfig(**SMALL_DIT)).eval()
    fused.load_state_dict(ours.state_dict(), strict=True)
    fused.fuse_projections()
    names = set(fused.state_dict())
    assert {"transformer_blocks.0.attn.to_qkv.weight", "token_refiner.refiner_blocks.0.attn.to_qkv.weight"} <= names
    assert not any(n.endswith(("attn.to_q.weight", "attn.to_k.weight", "attn.to_v.weight")) for n in names)
    q = reference.transformer_blocks[1].attn.to_q.weight
    assert torch.equal(fused.transformer_blocks[1].attn.to_qkv.weight[: q.shape[0]], q)
    with torch.no_grad():
        expected = ours(video, audio, ours.embed_text(text), timestep, row_index, layout.packed)
        got = fused(video, audio, fused.embed_text(text), timestep, row_index, layout.packed)
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))


@pytest.mark.parametrize("layout", ["interleaved", "stacked"])
def test_native_keys_round_trip(ours, layout):
    sd = ours.state_dict()
    native = keys.diffusers_to_native(sd, SMALL_DIT["attention_head_dim"], layout)
    assert native_names.is_native_key_set(list(native))
    assert "blocks.0.attn.qkv_proj.weight" in native and "video_patch_proj.weight" in native
    assert not native_names.is_native_key_set(list(sd))
    back = {}
    for k, v in native.items():
        back.update(keys.split_native_tensor(native_names.native_to_diffusers_name(k), v, 2, 32, layout))
    assert set(back) == set(sd)
    for k in sd:
        assert torch.equal(back[k], sd[k]), k


def test_native_interleaved_qkv_matches_spec():
    """Per-head interleaving: rows of head h are [q_h; k_h; v_h]."""
    heads, dh, d = 2, 3, 4
    q, k, v = (torch.randn(heads * dh, d) for _ in range(3))
    fused = torch.cat([torch.cat([x[h * dh : (h + 1) * dh] for x in (q, k, v)]) for h in range(heads)])
    out = dict(keys.split_native_tensor("b.attn.qkv_proj.weight", fused, heads, dh, "interleaved"))
    assert torch.equal(out["b.attn.to_q.weight"], q) and torch.equal(out["b.attn.to_v.weight"], v)


def test_native_ffn_halves_are_swapped():
    gate, value = torch.randn(4, 2), torch.randn(4, 2)
    out = dict(keys.split_native_tensor("b.ff.net.0.proj.weight", torch.cat([gate, value]), 1, 1, "stacked"))
    assert torch.equal(out["b.ff.net.0.proj.weight"], torch.cat([value, gate]))


def test_rejects_head_dim_too_small_for_rope():
    with pytest.raises(ValueError, match="rope_freq_dim"):
        H3Transformer(H3TransformerConfig(**{**SMALL_DIT, "attention_head_dim": 16}))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_chunks_keep_the_output_bit_identical(ours, dtype):
    """The denoise working set in row chunks (`TransformerBlock.row_chunk`, chosen by the planner) is the same
    per-row math: the output is bit-identical for chunks that do not divide the rows (spans of equal size: a
    GEMM of under 8 rows rounds differently on CPU)."""
    layout, video, audio, text, timestep, row_index = _inputs()
    model = H3Transformer(H3TransformerConfig(**SMALL_DIT)).eval()
    model.load_state_dict(ours.state_dict(), strict=True)
    model.fuse_projections()
    model.to(dtype)
    rows = layout.packed.seq_len

    def run(chunk: int | None):
        for block in model.transformer_blocks:
            block.row_chunk = chunk
        with torch.no_grad():
            return model(video, audio, model.embed_text(text.to(dtype)), timestep, row_index, layout.packed)

    whole = run(None)
    assert row_spans(10, 4) == [slice(0, 4), slice(4, 7), slice(7, 10)] and row_spans(8, 8) == [slice(0, 8)]
    for chunk in (16, rows // 2 + 1, rows):
        got = run(chunk)
        assert all(torch.equal(a, b) for a, b in zip(got, whole, strict=True)), chunk
