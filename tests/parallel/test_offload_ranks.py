"""Offload on CPU ranks (gloo, 1 thread each): DLO all-gather under Ulysses 2 (also serving a LoRA adapter, whose
factors are gathered with their block), rank-local DLO under TP2 with 0, 1 and all resident blocks, and the text
encoder offloaded under text-encoder TP2. Every output is byte-identical to the same layout without offload, on
every rank."""

from __future__ import annotations

import json

import pytest
from offload_sessions import dlo, offload_cases
from rank_harness import run_ranks
from read_counter import dit_file_bytes

from h3serve.config.engine_config import DEFAULT_ADALN_MEMO_BYTES, DEFAULT_PROMPT_CACHE_BYTES
from h3serve.config.offload_config import OffloadConfig
from h3serve.loading.dit_pieces import BlockPieces
from h3serve.offload.lora_bytes import ADAPTERS
from h3serve.offload.pieces import PieceSources
from h3serve.offload.placement_plan import ADALN_MEMO, PROMPT_CACHE
from h3serve.tools.tiny.make_adapter import write_peft_adapter

pytestmark = pytest.mark.slow

NUM_LAYERS = 6  # the tiny preset's DiT blocks
CASES = [
    ("dlo_allgather_u2", {"ulysses_degree": 2}, dlo("allgather")),
    ("dlo_allgather_u2_lora", {"ulysses_degree": 2}, dlo("allgather")),  # + lora_paths (the fixture's adapter)
    ("dlo_local_u2", {"ulysses_degree": 2}, dlo("rank-local")),
    ("dlo_local_tp2_k0", {"tensor_parallel_size": 2}, dlo("rank-local", 0)),
    ("dlo_local_tp2_k1", {"tensor_parallel_size": 2}, dlo("rank-local", 1)),
    ("dlo_local_tp2_all", {"tensor_parallel_size": 2}, dlo("rank-local", NUM_LAYERS)),
    ("encoder_staged_te_tp2", {"text_encoder_tp_size": 2}, OffloadConfig(staged=frozenset({"text_encoder", "dit"}))),
    ("encoder_streamed_te_tp2", {"text_encoder_tp_size": 2}, OffloadConfig(streamed=frozenset({"text_encoder"}))),
]


@pytest.fixture(scope="module")
def ranks(tiny_checkpoint, tmp_path_factory):
    cfg = json.loads((tiny_checkpoint / "transformer" / "config.json").read_text())
    adapter = write_peft_adapter(tmp_path_factory.mktemp("lora") / "a", cfg, rank=4, alpha=4.0, seed=1, std=0.3)
    lora = {"lora_paths": (("a", str(adapter)),)}
    cases = [(n, layout | lora if n.endswith("_lora") else layout, o) for n, layout, o in CASES]
    return run_ranks(2, offload_cases, tiny_checkpoint, cases, timeout_s=600)


@pytest.mark.parametrize("name", [name for name, _, _ in CASES])
def test_offload_is_byte_identical_on_every_rank(ranks, name):
    for rank in ranks:
        got, resident = rank[name], rank["resident"][rank[name]["layout_key"]]
        assert got["video"].tobytes() == resident["video"].tobytes(), f"rank {ranks.index(rank)}: video differs"
        assert got["audio"].tobytes() == resident["audio"].tobytes()
        assert resident["video"].std() > 0.01  # a real picture, not a vacuous comparison


@pytest.mark.parametrize("name", [name for name, _, _ in CASES])
def test_every_rank_places_every_stage_as_planned(ranks, name):
    for rank in ranks:
        got = rank[name]
        assert got["mismatches"] == [], f"rank {ranks.index(rank)}"
        # The LoRA host cache, the AdaLN memo's store and the prompt cache (planned at their bounds) belong to their
        # runtimes and fill as requests come, not to the placement (tests/offload/test_adapter_bytes, test_planner,
        # tests/rank/test_placement).
        runtime_stores = (ADAPTERS, ADALN_MEMO, PROMPT_CACHE)
        planned = {c: n for c, n in got["planned_host_bytes"].items() if c not in runtime_stores}
        assert got["planned_host_bytes"][ADALN_MEMO] == DEFAULT_ADALN_MEMO_BYTES  # every case runs the memo
        assert got["planned_host_bytes"][PROMPT_CACHE] == DEFAULT_PROMPT_CACHE_BYTES  # and the prompt cache
        if name.startswith("dlo_allgather"):  # each tensor of a gathered block keeps its alignment: < 64 B of padding
            host = got["host_bytes"]
            assert planned.keys() == host.keys()
            tensors = 20 * (1 + NUM_LAYERS)  # 12 weights and 8 LoRA factors at most in each block
            assert all(0 <= host[c] - planned[c] <= 64 * tensors for c in planned)
        else:
            assert got["host_bytes"] == planned
    for key, resident in ranks[0]["resident"].items():
        assert resident["mismatches"] == [], key


def test_all_gather_keeps_half_of_every_streamed_block_per_rank(ranks):
    for rank in ranks:
        gathered, local = rank["dlo_allgather_u2"], rank["dlo_local_u2"]
        # Both rebuild whole blocks on the device; the host keeps 1/2 of each block (padded to equal pieces).
        stream = gathered["peaks"]["denoise"][("transformer", "stream")]
        assert stream == local["peaks"]["denoise"][("transformer", "stream")] > 0
        whole, piece = local["host_bytes"]["transformer"], gathered["host_bytes"]["transformer"]
        tensors = 12 * (1 + NUM_LAYERS)  # at most 12 tensors in each of the refiner block and the DiT blocks
        assert whole / 2 <= piece <= whole / 2 + tensors * 64  # alignment padding: under 64 B a tensor


def test_all_gather_ranks_read_only_their_piece_of_the_dit_blocks(ranks, tiny_checkpoint):
    """DLO all-gather reads each block's piece from the files (h3serve.loading.dit_pieces), not the whole DiT."""
    folder = tiny_checkpoint / "transformer"
    resident, blocks, slack = dit_file_bytes(folder, BlockPieces(PieceSources(), adaln_on_host=True).lazy)
    for rank in ranks:
        assert rank["resident"][rank["dlo_allgather_u2"]["layout_key"]]["dit_read"] == resident + blocks
        assert resident + blocks / 3 < rank["dlo_allgather_u2"]["dit_read"] <= resident + blocks / 2 + slack
    assert sum(rank["dlo_allgather_u2"]["dit_read"] for rank in ranks) <= 2 * resident + blocks + 2 * slack


def test_resident_blocks_are_on_the_device_for_denoise_only(ranks):
    for rank in ranks:
        for name, k in (("dlo_local_tp2_k0", 0), ("dlo_local_tp2_k1", 1), ("dlo_local_tp2_all", NUM_LAYERS)):
            peaks = rank[name]["peaks"]
            base = peaks["text_encode"][("transformer", "resident")]
            during = peaks["denoise"][("transformer", "resident")]
            block = rank["dlo_local_tp2_k0"]["peaks"]["denoise"][("transformer", "stream")] // 2
            assert during - base == k * block
            assert peaks["video_decode"][("transformer", "resident")] == base
            stream = peaks["denoise"][("transformer", "stream")]
            if k < NUM_LAYERS:  # double buffering: two block slots
                assert stream == 2 * block
            else:  # every DiT block resident: only the token refiner's block still streams, through one slot
                # (with the AdaLN projections off the device a refiner block weighs no more than a DiT block)
                assert 0 < stream <= block


def test_staged_encoder_shards_leave_the_device_after_text_encoding(ranks):
    for rank in ranks:
        peaks = rank["encoder_staged_te_tp2"]["peaks"]
        assert peaks["text_encode"][("text_encoder", "resident")] > 0
        assert all(peaks[s][("text_encoder", "resident")] == 0 for s in ("denoise", "video_decode", "audio_decode"))
        dit = ("transformer", "resident")
        assert peaks["denoise"][dit] > 0 == peaks["text_encode"].get(dit, 0)
        streamed = rank["encoder_streamed_te_tp2"]["peaks"]
        assert streamed["text_encode"][("text_encoder", "stream")] > 0
        assert streamed["denoise"][("text_encoder", "stream")] == 0
