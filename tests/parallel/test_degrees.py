"""Parallel layouts: validation against the model's shapes (real model sizes), rank coordinates and groups."""

from __future__ import annotations

import pytest

from h3serve.errors import ConfigError
from h3serve.parallel.degrees import ModelDims, ParallelDegrees, check_degrees, parallel_notices

H3 = ModelDims(dit_heads=56, dit_ffn=14336, dit_hidden=5376, text_heads=64, text_kv_heads=8)


def _check(**kw) -> None:
    d = ParallelDegrees(**kw)
    check_degrees(ParallelDegrees(**{**kw, "world_size": kw.get("world_size", d.dit_group)}), H3)


@pytest.mark.parametrize("tp", [1, 2, 4, 7, 8, 14, 28, 56])
def test_every_divisor_of_the_heads_is_a_valid_tp(tp):
    _check(tensor_parallel=tp)


@pytest.mark.parametrize(
    "kw, message",
    [
        ({"tensor_parallel": 3}, r"num_attention_heads must be divisible by tensor_parallel_size \(56 % 3 != 0\); "
         r"choose from: 1, 2, 4, 7, 8, 14, 28, 56"),
        ({"tensor_parallel": 2, "ulysses": 8}, r"local attention heads must be divisible by ulysses_degree "
         r"\(\(56 / tp 2\) % 8 != 0\); choose from: 1, 2, 4, 7, 14, 28"),
        ({"ulysses": 2, "world_size": 3}, r"--num-gpus 3 must be a multiple of .* = 2; use --num-gpus 2"),
        ({"text_encoder_tp": 16, "world_size": 16}, r"must divide both .* \(64\) and num_key_value_heads \(8\); "
         r"choose from: 1, 2, 4, 8"),
        ({"text_encoder_tp": 4, "world_size": 2}, r"--text-encoder-tp-size 4 must not exceed the group size \(2"),
        ({"vae_patch_parallel": 2, "ulysses": 4, "world_size": 4}, r"one rank or the whole group; choose from: 1, 4"),
        ({"ring": 0}, r"--ring/--ring-degree must be >= 1, got 0"),
    ],
)
def test_impossible_layouts_name_the_fix(kw, message):
    with pytest.raises(ConfigError, match=message):
        _check(**kw)


def test_ffn_divisibility_is_checked_too():
    odd_ffn = ModelDims(dit_heads=8, dit_ffn=12, dit_hidden=64, text_heads=2, text_kv_heads=2)
    with pytest.raises(ConfigError, match=r"FFN width \(12\) .* choose from: 1, 2, 4"):
        check_degrees(ParallelDegrees(tensor_parallel=8, world_size=8), odd_ffn)


def test_cfg_parallel_and_other_vae_modes_are_refused():
    with pytest.raises(ConfigError, match="CFG-distilled and has no negative branch; cfg_parallel_size must be 1"):
        check_degrees(ParallelDegrees(), H3, cfg_parallel_size=2)
    with pytest.raises(ConfigError, match="tile parallel mode only; choose from: tile"):
        check_degrees(ParallelDegrees(), H3, vae_parallel_mode="spatial_shard_width")


def test_replicas_are_announced():
    d = ParallelDegrees(ulysses=2, world_size=4, vae_patch_parallel=4, text_encoder_tp=4)
    check_degrees(d, H3)
    assert d.replicas == 2 and "2 identical replicas" in parallel_notices(d)[0]
    assert parallel_notices(ParallelDegrees(ulysses=2, world_size=2)) == []


def test_rank_layout_keeps_tp_innermost_and_sequence_chunks_in_rank_order():
    d = ParallelDegrees(tensor_parallel=2, ulysses=2, ring=2, world_size=8)
    assert [d.coords(r).tp for r in range(8)] == [0, 1] * 4
    assert d.group_ranks(5, ("tp",)) == [4, 5]
    assert d.group_ranks(5, ("ulysses",)) == [5, 7]
    assert d.group_ranks(5, ("ring",)) == [1, 5]
    sp = d.group_ranks(5, ("ulysses", "ring"))
    assert sp == [1, 3, 5, 7]
    # ascending global rank inside a sequence-parallel group is ascending chunk index ring·U + ulysses
    assert [d.coords(r).ring * 2 + d.coords(r).ulysses for r in sp] == [0, 1, 2, 3]
    assert all(d.rank_of(d.coords(r)) == r for r in range(8))
