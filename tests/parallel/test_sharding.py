"""Single-process pieces of the parallel strategies: sliced TP loading (diffusers and native layouts), the
online-softmax merge behind Ring attention, and the text-encoder key mapping."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file
from tiny_parallel import PARALLEL_DIT, randomize_

from h3serve.accel.attention import BACKENDS
from h3serve.checkpoint.text_encoder_names import checkpoint_key_to_name
from h3serve.loading import dit_keys as keys
from h3serve.loading.components import load_transformer
from h3serve.model.transformer import H3Transformer, H3TransformerConfig
from h3serve.parallel.ring import merge_partial
from h3serve.parallel.tensor_parallel import GatheredColumnLinear, RowParallelLinear, TensorParallel


@pytest.fixture(scope="module")
def full_dit() -> H3Transformer:
    model = H3Transformer(H3TransformerConfig(**PARALLEL_DIT))
    randomize_(model, seed=7)
    return model.eval()


def _save(folder, state: dict[str, torch.Tensor]) -> None:
    folder.mkdir()
    save_file({k: v.contiguous() for k, v in state.items()}, str(folder / "diffusion_pytorch_model.safetensors"))
    (folder / "config.json").write_text(json.dumps(PARALLEL_DIT))


def _expected_shard(name: str, full: torch.Tensor, rank: int) -> torch.Tensor:
    """What rank `rank` of 2 must hold, written out by hand per projection."""
    if name.endswith(("to_q.weight", "to_k.weight", "to_v.weight", "adaln_proj.linear.weight",
                      "adaln_proj.linear.bias")):
        return full.chunk(2, dim=0)[rank]
    if name.endswith("ff.net.0.proj.weight"):
        value, gate = full.chunk(2, dim=0)
        return torch.cat([value.chunk(2)[rank], gate.chunk(2)[rank]])
    if name.endswith(("to_out.0.weight", "ff.net.2.weight")):
        return full.chunk(2, dim=1)[rank]
    return full


@pytest.mark.parametrize("layout", ["diffusers", "interleaved", "stacked"])
def test_each_rank_reads_exactly_its_slices(tmp_path, full_dit, layout):
    state = full_dit.state_dict()
    stored = state if layout == "diffusers" else keys.diffusers_to_native(state, 32, layout)
    _save(tmp_path / "dit", stored)
    sharded_names = set()
    for rank in range(2):
        tp = TensorParallel(rank, 2, None, H3Transformer.tensor_parallel_plan)
        shard = load_transformer(tmp_path / "dit", qkv_layout="interleaved" if layout == "diffusers" else layout, tp=tp)
        for name, value in shard.state_dict().items():
            expected = _expected_shard(name, state[name], rank)
            assert torch.equal(value, expected), name
            if value.shape != state[name].shape:
                sharded_names.add(name)
        assert isinstance(shard.transformer_blocks[0].attn.to_out[0], RowParallelLinear)
        assert isinstance(shard.transformer_blocks[1].adaln_proj.linear, GatheredColumnLinear)
        assert shard.token_refiner.refiner_blocks[0].attn.to_q.out_features == 64  # 2 of 4 heads
    # per block 7 projections + the AdaLN bias; per refiner block 6
    assert len(sharded_names) == PARALLEL_DIT["num_layers"] * 8 + PARALLEL_DIT["num_refiner_layers"] * 6


def test_unknown_style_and_unmatched_plan_are_errors(full_dit):
    with pytest.raises(ValueError, match="unknown tensor-parallel styles"):
        TensorParallel(0, 2, None, {"*.to_q": "diagonal"})
    with pytest.raises(ValueError, match="matched no module"):
        TensorParallel(0, 2, None, {"nothing.*": "colwise"}).shard_module(full_dit)


def test_online_softmax_merge_over_key_blocks_is_exact():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 3, 11, 16, generator=g) for _ in range(3))
    reference = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    acc = None
    for lo, hi in ((0, 4), (4, 9), (9, 11)):  # unequal blocks, as Ring sees after cutting padded keys
        acc = merge_partial(acc, *BACKENDS["TORCH_SDPA"].with_lse(q, k[:, :, lo:hi], v[:, :, lo:hi]))
    assert (acc[0] - reference).abs().max() < 1e-6
    scores = (q @ k.transpose(-1, -2)) * 16**-0.5
    assert (acc[1] - torch.logsumexp(scores, -1)).abs().max() < 1e-5


def test_text_encoder_keys_map_to_model_names():
    assert checkpoint_key_to_name("model.language_model.layers.3.mlp.up_proj.weight", 51) == (
        "language_model.layers.3.mlp.up_proj.weight"
    )
    assert checkpoint_key_to_name("model.layers.3.self_attn.q_proj.weight", 51) == (
        "language_model.layers.3.self_attn.q_proj.weight"
    )
    assert checkpoint_key_to_name("model.visual.merger.norm.bias", 51) == "visual.merger.norm.bias"
    assert checkpoint_key_to_name("model.language_model.layers.51.mlp.up_proj.weight", 51) is None
    assert checkpoint_key_to_name("lm_head.weight", 51) is None


def test_full_size_dit_shard_is_about_half_per_rank(capsys):
    """The released architecture (on the meta device: shapes only): TP2 per-rank parameter bytes vs TP1."""
    with torch.device("meta"):
        whole = H3Transformer(H3TransformerConfig())
        shard = H3Transformer(H3TransformerConfig())
    TensorParallel(0, 2, None, H3Transformer.tensor_parallel_plan).shard_module(shard)
    assert all(p.is_meta for p in shard.parameters())  # sharding a skeleton allocates nothing
    tp1, tp2 = (sum(p.numel() * 2 for p in m.parameters()) for m in (whole, shard))  # bf16 bytes
    with capsys.disabled():
        print(f"\nfull-size DiT, bf16 bytes per rank: TP1 {tp1 / 2**30:.2f} GiB | TP2 {tp2 / 2**30:.2f} GiB "
              f"({tp2 / tp1:.3f} of TP1)")
    assert 0.49 < tp2 / tp1 < 0.51
