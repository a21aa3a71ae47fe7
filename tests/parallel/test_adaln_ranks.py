"""AdaLN memoisation on two CPU ranks (gloo, 1 thread each): memo on or off, the projections on the device or
in host memory, a sidecar miss or hit, under TP2, Ulysses 2 and rank-local DLO: raw arrays (and MP4s) equal on
every rank."""

from __future__ import annotations

import pytest
from adaln_sessions import adaln_cases
from rank_harness import run_ranks

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ranks(tiny_checkpoint, tmp_path_factory):
    return run_ranks(2, adaln_cases, tiny_checkpoint, tmp_path_factory.mktemp("adaln"), timeout_s=900)


@pytest.mark.parametrize(
    "name, reference",
    [("tp2_host_miss", "tp2_off"), ("tp2_device_hit", "tp2_off"), ("dlo_tp2", "tp2_off"), ("u2_host_miss", "u2_off")],
)
def test_memoised_runs_equal_the_forward_computing_them(ranks, name, reference):
    for rank in ranks:
        got, ref = rank[name], rank[reference]
        assert got["video"].tobytes() == ref["video"].tobytes(), f"rank {ranks.index(rank)}: {name} video differs"
        assert got["audio"].tobytes() == ref["audio"].tobytes()
        assert ref["video"].std() > 0.01 and ref["misses"] is None


def test_sidecars_miss_then_hit_and_projections_leave_the_device(ranks):
    assert ranks[0]["tp2_device_hit"]["mp4"] == ranks[0]["tp2_off"]["mp4"]
    for rank in ranks:
        assert set(rank["tp2_host_miss"]["sidecars"].values()) == {"missing"}
        assert rank["tp2_host_miss"]["misses"] > 0 and rank["tp2_host_miss"]["adaln_host"] > 0
        hit = rank["tp2_device_hit"]
        assert set(hit["sidecars"].values()) == {"hit"} and hit["misses"] == 0 and hit["adaln_host"] == 0
        assert rank["dlo_tp2"]["adaln_host"] > 0  # implied by streaming the DiT with the memo on
    # Each TP rank holds its shard of the blocks' projections (norm_out.linear is whole): Ulysses keeps them whole.
    tp2, u2 = ranks[0]["tp2_host_miss"]["adaln_host"], ranks[0]["u2_host_miss"]["adaln_host"]
    assert u2 / 2 < tp2 < u2
