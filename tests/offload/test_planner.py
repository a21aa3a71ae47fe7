"""The memory planner: byte inventory from shapes, placement per offload mode, auto K, the model card's peaks."""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import replace

import pytest
import torch

from h3serve.checkpoint.resolver import read_layout
from h3serve.config.offload_config import OffloadConfig, OffloadError, parse_bytes
from h3serve.loading.components import load_components, load_transformer
from h3serve.model.transformer import H3Transformer
from h3serve.offload.activations import RequestShape
from h3serve.offload.inventory import RELEASED, build_inventory
from h3serve.offload.placement_plan import GiB, stages_for
from h3serve.offload.plan_report import format_plan, plan_json
from h3serve.offload.planner import Runtime, plan_placement
from h3serve.offload.request_shapes import default_shape, plan_largest
from h3serve.parallel.degrees import ParallelDegrees
from h3serve.parallel.tensor_parallel import TensorParallel

DITS = ("transformer", "transformer_ref")
MODULE = OffloadConfig(staged=frozenset({"dit", "text_encoder", "vae", "audio_vae"}))
LAYERWISE = OffloadConfig(staged=frozenset({"text_encoder", "vae", "audio_vae"}), streamed=frozenset({"dit"}))


def module_bytes(module: torch.nn.Module) -> int:
    """What `.to(device)` moves: every parameter and buffer."""
    return sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])


def dlo(transfer: str, resident: int | str = 0) -> OffloadConfig:
    return OffloadConfig(
        staged=frozenset({"text_encoder", "vae", "audio_vae"}),
        streamed=frozenset({"dit"}),
        distributed=True,
        transfer=transfer,
        resident_layers=resident,
    )


@pytest.fixture(scope="module")
def released():
    return build_inventory(RELEASED)


@pytest.fixture(scope="module")
def tiny_layout(tiny_checkpoint):
    return read_layout(tiny_checkpoint)


@pytest.fixture(scope="module")
def tiny_shape(tiny_layout):
    return default_shape(tiny_layout.defaults(), "t2va")


# ------------------------------------------------------------------------------------------------------------
# Inventory
# ------------------------------------------------------------------------------------------------------------


def test_released_inventory_matches_the_spec_parameter_counts(released):
    held = released.ranks[0]
    assert held["transformer"].params == held["transformer_ref"].params == 33_122_992_896
    assert held["vae"].params == 2_603_868_984
    # The spec's 151,321,489 less the 39,329 weight-norm gains folded into their weights on load
    # (h3serve.model.audio_decode): what is resident.
    assert held["audio_vae"].params == 151_321_489 - 39_329
    assert held["audio_vae"].total_bytes >= 4 * held["audio_vae"].params  # fp32 whatever the engine dtype
    # "a 51.5 GB encoder": the 51 decoder layers h3serve loads, the vision tower and the embeddings, in bf16.
    assert held["text_encoder"].total_bytes == pytest.approx(51.5e9, rel=0.05)
    assert len(held["text_encoder"].group("language_model.layers").block_bytes) == 51
    dit = held["transformer"]
    assert [len(g.block_bytes) for g in dit.groups] == [2, 50]
    assert dit.total_bytes == pytest.approx(66.3e9, rel=0.01)  # "two DiTs of 66.3 GB"


def test_tensor_parallel_two_holds_about_half(released):
    half = build_inventory(RELEASED, ParallelDegrees(tensor_parallel=2, text_encoder_tp=2, world_size=2), DITS)
    for rank in half.ranks:
        dit, full = rank["transformer"], released.ranks[0]["transformer"]
        assert dit.total_bytes == pytest.approx(full.total_bytes / 2, rel=0.01)
        block, full_block = (c.group("transformer_blocks").block_bytes[0] for c in (dit, full))
        assert full_block / 2 < block < full_block / 2 * 1.001  # the norms stay whole
        layer, full_layer = (
            inv.ranks[0]["text_encoder"].group("language_model.layers").block_bytes[0] for inv in (half, released)
        )
        assert full_layer / 2 < layer < full_layer / 2 * 1.001


def test_text_encoder_lives_on_rank_zero_or_the_text_encoder_group():
    whole = build_inventory(RELEASED, ParallelDegrees(ulysses=2, world_size=2), ("transformer",))
    assert "text_encoder" in whole.ranks[0] and "text_encoder" not in whole.ranks[1]
    shared = build_inventory(RELEASED, ParallelDegrees(ulysses=4, text_encoder_tp=2, world_size=4), ("transformer",))
    assert [("text_encoder" in r) for r in shared.ranks] == [True, True, False, False]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_tiny_inventory_equals_the_loaded_components(tiny_layout, dtype):
    inv = build_inventory(tiny_layout.root, dits=DITS, device_type="cpu", dtype=dtype)
    loaded = load_components(tiny_layout, dtype=dtype)
    modules = {
        "transformer": loaded.transformer,
        "transformer_ref": loaded.transformer_ref,
        "vae": loaded.vae,
        "audio_vae": loaded.audio_vae,
        "text_encoder": loaded.text.model,
    }
    assert set(inv.ranks[0]) == set(modules)
    for name, module in modules.items():
        assert inv.ranks[0][name].total_bytes == module_bytes(module), name
        assert inv.ranks[0][name].params == sum(p.numel() for p in module.parameters()), name
    blocks = inv.ranks[0]["transformer"].group("transformer_blocks").block_bytes
    assert blocks == tuple(module_bytes(b) for b in loaded.transformer.transformer_blocks)


def test_tiny_dit_tensor_parallel_shard_equals_the_loaded_shard(tiny_layout):
    cfg = build_inventory(tiny_layout.root, dits=("transformer",), device_type="cpu").dits["transformer"]
    if cfg.num_attention_heads % 2 or cfg.ffn_dim % 2:
        pytest.skip("the tiny DiT does not split in two")
    inv = build_inventory(
        tiny_layout.root, ParallelDegrees(tensor_parallel=2, world_size=2), ("transformer",), device_type="cpu"
    )
    for rank in range(2):
        tp = TensorParallel(rank, 2, None, H3Transformer.tensor_parallel_plan)
        shard = load_transformer(tiny_layout.component("transformer"), tp=tp)
        assert inv.ranks[rank]["transformer"].total_bytes == module_bytes(shard)


# ------------------------------------------------------------------------------------------------------------
# Placement per mode (expectations derived from the inventory, never from hard-coded tiny sizes)
# ------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_inv(tiny_layout):
    return build_inventory(tiny_layout.root, dits=DITS, device_type="cpu")


def test_no_offload_keeps_every_component_on_the_device_in_every_stage(tiny_inv, tiny_shape):
    plan = plan_placement(tiny_inv, OffloadConfig(), tiny_shape)
    for stage in plan.ranks[0].stages:
        for name, c in tiny_inv.ranks[0].items():
            assert stage.component_peak(name) == c.total_bytes
        assert not stage.stream_buffers
    assert plan.ranks[0].host_bytes == {}
    assert [s.stage for s in plan.ranks[0].stages] == list(stages_for("t2va"))
    assert "vae_encode" not in stages_for("t2va") and "vae_encode" in stages_for("ref2va")


@pytest.mark.parametrize("task", ["t2va", "fl2va", "ref2va"])
def test_module_offload_puts_each_component_on_the_device_in_its_own_stages_only(tiny_inv, tiny_shape, task):
    shape = RequestShape(tiny_shape.width, tiny_shape.height, tiny_shape.num_frames, task)
    rank = plan_placement(tiny_inv, MODULE, shape).ranks[0]
    dit = "transformer_ref" if task == "ref2va" else "transformer"
    expected = {
        "text_encoder": {"text_encode"},
        "vae": {"vae_encode", "video_decode"},
        "audio_vae": {"audio_decode", *(["vae_encode"] if task == "ref2va" else [])},
        dit: {"denoise"},
        ({"transformer", "transformer_ref"} - {dit}).pop(): set(),
    }
    for name, stages in expected.items():
        total = tiny_inv.ranks[0][name].total_bytes
        for stage in rank.stages:
            assert stage.component_peak(name) == (total if stage.stage in stages else 0), (name, stage.stage)
        assert rank.host_bytes[name] == total


def test_layerwise_streams_the_task_dit_and_keeps_only_the_base_of_the_other(tiny_inv, tiny_shape):
    # With the AdaLN memo (the default) the projections leave the blocks and the base for host memory.
    rank = plan_placement(tiny_inv, LAYERWISE, tiny_shape).ranks[0]
    whole, ref_whole = tiny_inv.ranks[0]["transformer"], tiny_inv.ranks[0]["transformer_ref"]
    main, ref = whole.without_adaln(), ref_whole.without_adaln()
    largest = max(b for g in main.groups for b in g.block_bytes)
    for stage in rank.stages:
        assert stage.weights["transformer"] == main.base_bytes
        assert stage.weights["transformer_ref"] == ref.base_bytes
        assert stage.stream_buffers.get("transformer", 0) == (2 * largest if stage.stage == "denoise" else 0)
        assert "transformer_ref" not in stage.stream_buffers
        assert stage.stream_buffers.get("adaln", 0) == (max(whole.adaln_blocks) if stage.stage == "denoise" else 0)
        assert (stage.modulations > 0) == (stage.stage == "denoise")
    assert rank.host_bytes["transformer"] == main.total_bytes - main.base_bytes
    assert rank.host_bytes["adaln"] == whole.adaln_bytes + ref_whole.adaln_bytes
    # Without the memo the projections stream inside their blocks, as before.
    before = plan_placement(tiny_inv, LAYERWISE, tiny_shape, memo=False).ranks[0]
    whole_largest = max(b for g in whole.groups for b in g.block_bytes)
    assert before.stage("denoise").stream_buffers["transformer"] == 2 * whole_largest
    assert "adaln" not in before.host_bytes and before.stage("denoise").modulations == 0


def test_dlo_allgather_keeps_one_gth_of_each_block_on_the_host(tiny_layout, tiny_shape):
    inv = build_inventory(tiny_layout.root, ParallelDegrees(ulysses=2, world_size=2), DITS, device_type="cpu")
    plan = plan_placement(inv, dlo("allgather"), tiny_shape)
    main = inv.ranks[0]["transformer"].without_adaln()
    blocks = [b for g in main.groups for b in g.block_bytes]
    for rank in plan.ranks:
        assert rank.host_bytes["transformer"] == sum(math.ceil(b / 2) for b in blocks)
        assert rank.stage("denoise").stream_buffers["transformer"] == 2 * max(blocks)  # the whole block, rebuilt


def test_dlo_rank_local_resident_prefix_during_denoise_only(tiny_layout, tiny_shape):
    inv = build_inventory(tiny_layout.root, ParallelDegrees(tensor_parallel=2, world_size=2), DITS, device_type="cpu")
    main = inv.ranks[0]["transformer"].without_adaln()
    blocks = main.group("transformer_blocks").block_bytes
    refiner = main.group("token_refiner.refiner_blocks").block_bytes
    n = len(blocks)
    for k in sorted({0, 1, n}):
        if n - k == 1:
            continue
        plan = plan_placement(inv, dlo("rank-local", k), tiny_shape)
        assert plan.resident_layers == k
        for rank in plan.ranks:
            denoise = rank.stage("denoise")
            assert denoise.weights["transformer"] == main.base_bytes + sum(blocks[:k])
            assert denoise.stream_buffers["transformer"] == 2 * max([*blocks[k:], *refiner])
            assert rank.stage("video_decode").weights["transformer"] == main.base_bytes  # released before decode
            # The Ref2VA DiT never keeps resident blocks.
            assert denoise.weights["transformer_ref"] == inv.ranks[0]["transformer_ref"].without_adaln().base_bytes


def test_resident_layers_leaving_one_streamed_block_is_refused(tiny_layout, tiny_shape):
    inv = build_inventory(tiny_layout.root, dits=("transformer",), device_type="cpu")
    n = inv.dits["transformer"].num_layers
    with pytest.raises(OffloadError, match="leaves only one streaming block"):
        plan_placement(inv, dlo("rank-local", n - 1), tiny_shape)
    with pytest.raises(OffloadError, match="has only"):
        plan_placement(inv, dlo("rank-local", n + 1), tiny_shape)


def test_a_task_whose_dit_is_not_loaded_is_refused(tiny_layout, tiny_shape):
    inv = build_inventory(tiny_layout.root, dits=("transformer_ref",), device_type="cpu")
    with pytest.raises(OffloadError, match="not loaded"):
        plan_placement(inv, OffloadConfig(), tiny_shape)


# ------------------------------------------------------------------------------------------------------------
# auto K
# ------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def released_tp2():
    return build_inventory(
        RELEASED, ParallelDegrees(tensor_parallel=2, text_encoder_tp=2, world_size=2), ("transformer",)
    )


def test_auto_picks_the_largest_k_that_fits(released_tp2):
    inv = released_tp2
    shape = RequestShape(1024, 576, 124, "t2va")
    streamed = OffloadConfig(
        staged=frozenset({"vae", "audio_vae"}),
        streamed=frozenset({"dit", "text_encoder"}),
        distributed=True,
        transfer="rank-local",
        resident_layers=12,
    )
    at_12 = plan_placement(inv, streamed, shape).peak_device_bytes
    at_13 = plan_placement(inv, replace(streamed, resident_layers=13), shape)
    assert at_13.peak_device_bytes > at_12
    auto = replace(streamed, resident_layers="auto")
    headroom = GiB
    assert plan_placement(inv, auto, shape, at_12 + headroom, headroom).resident_layers == 12
    assert plan_placement(inv, auto, shape, at_12 + headroom - 1, headroom).resident_layers == 11
    assert plan_placement(inv, auto, shape, 10**15, headroom).resident_layers == 50  # everything resident
    with pytest.raises(OffloadError, match="even with 0 resident blocks"):
        plan_placement(inv, auto, shape, 4 * GiB, headroom)
    with pytest.raises(OffloadError, match="--device-memory"):
        plan_placement(inv, auto, shape)


def test_auto_never_leaves_exactly_one_streamed_block(released_tp2):
    # All 50 blocks resident need 50 blocks + two refiner slots; 49 would need 49 + two block slots (less), but
    # a lone streamed block cannot double-buffer: auto must step from 50 straight down to 48.
    # (Without the memo: with it, 50 blocks shorn of their AdaLN no longer outweigh the staged encoder.)
    shape = RequestShape(1024, 576, 124, "t2va")
    all_resident = plan_placement(released_tp2, dlo("rank-local", 50), shape, memo=False).peak_device_bytes
    plan = plan_placement(released_tp2, dlo("rank-local", "auto"), shape, all_resident - 1, memo=False)
    assert plan.resident_layers == 48


def test_plan_largest_keeps_the_task_that_needs_the_most(tiny_inv, tiny_layout):
    shapes = [default_shape(tiny_layout.defaults(), t) for t in ("t2va", "fl2va", "ref2va")]
    plan = plan_largest(tiny_inv, OffloadConfig(), shapes, None, 0)
    assert plan.peak_device_bytes == max(plan_placement(tiny_inv, OffloadConfig(), s).peak_device_bytes for s in shapes)


@pytest.mark.parametrize(
    "text, value", [("32GiB", 32 * GiB), ("24 GB", 24 * 10**9), ("80G", 80 * GiB), ("1.5GiB", 3 * GiB // 2)]
)
def test_parse_bytes(text, value):
    assert parse_bytes(text) == value


@pytest.mark.parametrize("text", ["", "GiB", "32 potatoes", "-1GiB", "0"])
def test_parse_bytes_refuses(text):
    with pytest.raises(ValueError, match="--device-memory"):
        parse_bytes(text)


# ------------------------------------------------------------------------------------------------------------
# Start-up
# ------------------------------------------------------------------------------------------------------------


def test_plan_for_engine_plans_the_default_canvas_of_the_largest_task(tiny_checkpoint, tiny_layout):
    from h3serve.config.engine_config import EngineConfig
    from h3serve.offload.plan_report import format_plan
    from h3serve.rank.placement import plan_for_engine

    config = EngineConfig(model=tiny_checkpoint, device="cpu", offload=MODULE)
    plan = plan_for_engine(config, device_memory=None)
    inv = build_inventory(tiny_checkpoint, dits=DITS, device_type="cpu")
    shapes = [default_shape(tiny_layout.defaults(), t) for t in ("t2va", "fl2va", "ref2va")]
    assert plan.peak_device_bytes == max(plan_placement(inv, MODULE, s).peak_device_bytes for s in shapes)
    assert plan.fits is None and plan.headroom == 0
    text = format_plan(plan)
    assert "peak" in text and "no --device-memory given" in text and "host pinned" in text
    small = plan_for_engine(config, device_memory=plan.peak_device_bytes, headroom=1)
    assert small.fits is False and "does not fit by 0.00 GiB" in format_plan(small)


def test_ring_holds_more_attention_state_than_ulysses(released):
    shape = RequestShape(1344, 768, 124, "t2va")
    ulysses = plan_placement(
        build_inventory(RELEASED, ParallelDegrees(ulysses=2, world_size=2), ("transformer",)), OffloadConfig(), shape
    )
    ring = plan_placement(
        build_inventory(RELEASED, ParallelDegrees(ring=2, world_size=2), ("transformer",)), OffloadConfig(), shape
    )
    assert ring.ranks[0].stage("denoise").activations > ulysses.ranks[0].stage("denoise").activations


def test_video_sparse_attention_tile_buffers_are_counted_from_the_real_tiling(released):
    """The planner's tile count is `video_sparse.tile_plan`'s for the request's packed sequence, and a VSA engine's
    denoise stage holds exactly its tile buffers more than the dense one (the released DiT, FL2VA 1344x768)."""
    from h3serve.accel.video_sparse import tile_plan
    from h3serve.offload.activations import vsa_buffers, vsa_tiles

    for shape in (RequestShape(1344, 768, 124, "fl2va"), RequestShape(448, 256, 107, "t2va")):
        grid = (shape.latent_frames, shape.height // 32, shape.width // 32)
        assert vsa_tiles(shape) == tile_plan(shape.seq_len, grid).num_tiles
    shape = RequestShape(1344, 768, 124, "fl2va")
    dense = plan_placement(released, OffloadConfig(), shape)
    sparse = plan_placement(released, OffloadConfig(), shape, runtime=Runtime(vsa=True))
    extra = sparse.ranks[0].stage("denoise").activations - dense.ranks[0].stage("denoise").activations
    cfg = released.dits["transformer"]
    assert extra == vsa_buffers(cfg, released.degrees, shape, released.element_size, "cuda") > 0.5 * GiB


# ------------------------------------------------------------------------------------------------------------
# Denoise row chunks (issue 29, item 12)
# ------------------------------------------------------------------------------------------------------------


def test_a_chunked_block_holds_only_the_attention_state_for_every_row(released):
    from h3serve.offload.activations import chunked_block, denoise

    d, heads, ffn, rows, es = 5376, 56 * 128, 14336, 42014, 2  # the released DiT, FL2VA 1344x768, 5 s
    whole_rows = rows * (2 * d + 4 * heads) * es  # the stream in and out; q, k, v and the attention output
    per_chunk = 4096 * max(3 * d + 7 * heads, 7 * d + 4 * ffn) * es  # the larger pass: the FFN's
    assert chunked_block(d, heads, ffn, rows, 4096, es) == whole_rows + per_chunk
    cfg = released.dits["transformer"]
    shape = RequestShape(1344, 768, 124, "fl2va")
    assert shape.seq_len == rows
    saved = denoise(cfg, ParallelDegrees(), shape, es) - denoise(cfg, ParallelDegrees(), shape, es, 4096)
    assert 4.0 * GiB < saved < 4.5 * GiB  # 8 of [S, D] + the FFN's 4 of [S, ffn] against the chunked working set
    assert denoise(cfg, ParallelDegrees(), shape, es, rows) == denoise(cfg, ParallelDegrees(), shape, es)


def test_auto_chunks_the_denoise_rows_only_where_whole_rows_do_not_fit(released):
    shape = RequestShape(1344, 768, 124, "fl2va")

    def plan(memory: int | None, chunk="auto"):
        return plan_placement(released, OffloadConfig(), shape, memory, GiB, runtime=Runtime(denoise_chunk_rows=chunk))

    whole, smallest = plan(None, None), plan(None, 1024)
    assert plan(None).denoise_chunk_rows is None  # no device size: no verdict, whole rows
    assert plan(whole.peak_device_bytes + GiB).denoise_chunk_rows is None  # whole rows fit: no chunks
    tight = plan(whole.peak_device_bytes)  # 1 GiB short with whole rows
    assert tight.fits and tight.denoise_chunk_rows == 16384 and tight.peak_device_bytes < whole.peak_device_bytes
    short = plan(smallest.peak_device_bytes)  # not even the smallest chunk fits: its plan says by how much
    assert short.fits is False and short.denoise_chunk_rows == 1024 and short.shortfall_bytes == GiB
    assert "denoise working set in chunks of 1024 rows" in format_plan(short)
    assert plan_json(short)["denoise_chunk_rows"] == 1024


def test_the_fl2va_plan_on_one_32_gib_card_fits_with_a_gib_of_headroom():
    """The issue's target: released FL2VA 1344x768, 5 s, FP8, the encoder, AdaLN and VAEs on the host, one 32 GiB
    card: whole rows miss by 0.25 GiB; the planner's row chunk makes it fit with the 1 GiB headroom kept."""
    from h3serve.entrypoints.plan import build_plan, register
    from h3serve.tools.bench.acceptance import FL2VA_OFFLOAD

    parser = argparse.ArgumentParser(prog="h3serve")
    register(parser.add_subparsers())
    argv = ["plan", "--preset", "released", "--task-type", "fl2va", "--task", "fl2va", "--width", "1344",
            "--height", "768", "--device", "cuda", "--device-memory", "32GiB", "--quantization", "fp8",
            "--diffusion-offload-config", json.dumps(FL2VA_OFFLOAD)]
    chunked, _ = build_plan(parser.parse_args(argv))
    whole, _ = build_plan(parser.parse_args([*argv, "--denoise-chunk-rows", "off"]))
    assert whole.fits is False and 0 < whole.shortfall_bytes < GiB // 2
    assert chunked.fits and chunked.headroom == GiB and chunked.denoise_chunk_rows == 16384
    assert chunked.device_memory - chunked.peak_device_bytes - chunked.headroom > GiB


def test_a_source_video_is_encoded_one_clip_at_a_time_and_counted(released):
    """An edit's or extension's source video (issue 29, item 5): the vae_encode stage runs for it whatever the task,
    and holds one 17-frame clip's pixels and feature maps beside the whole video's moments, not the three or four
    fp32 copies of the whole video it held before (4.5 GB each at 15 s, 1344x768)."""
    from h3serve.offload.activations import vae_encode
    from h3serve.rules import geometry

    shape = RequestShape(1344, 768, 362, "t2va", source_frames=362)
    assert "vae_encode" in [s.stage for s in plan_placement(released, OffloadConfig(), shape).ranks[0].stages]
    assert "vae_encode" not in [s.stage for s in plan_placement(released, OffloadConfig(), replace(
        shape, source_frames=0)).ranks[0].stages]
    v = released.vae
    clip = 17 * 3 * 1344 * 768 * (1 + 8) + 17 * 8 * v.encoder_width * v.tile**2 * 4
    moments = 2 * v.latent_channels * geometry.latent_frames(362) * (768 // 16) * (1344 // 16) * 4
    assert vae_encode(v, shape) == clip + moments
    before = 4 * 3 * 362 * 1344 * 768 * 4 + clip - 17 * 3 * 1344 * 768 * 9 + moments  # four whole fp32 copies
    assert vae_encode(v, shape) < before / 3


def test_a_control_requests_media_count_in_the_host_figure(tiny_inv, tiny_shape):
    """The ControlNet media the rank holds (float32 on the canvas, and the one source frame being resized) are in
    the plan's host bytes (issue 54: what the pixel budget leaves to the planner)."""
    from h3serve.offload.placement_plan import CONTROL_MEDIA
    from h3serve.rules import limits

    plain = plan_placement(tiny_inv, OffloadConfig(), tiny_shape).ranks[0]
    inpaint = plan_placement(tiny_inv, OffloadConfig(), replace(tiny_shape, control_channels=4)).ranks[0]
    canvas = 4 * tiny_shape.num_frames * tiny_shape.height * tiny_shape.width * 4
    assert CONTROL_MEDIA not in plain.host_bytes
    assert inpaint.host_bytes[CONTROL_MEDIA] == canvas + limits.MEDIA_MAX_FRAME_PIXELS * 3 * 5
    assert inpaint.total_host_bytes - plain.total_host_bytes == inpaint.host_bytes[CONTROL_MEDIA]
