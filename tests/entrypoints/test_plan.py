"""`h3serve plan`: the human table, --json, --preset released without files, and every refusal."""

from __future__ import annotations

import json

import pytest

from h3serve.entrypoints.cli import main
from h3serve.rules.realtime_geometry import kv_rows_bound

FIVE_090 = [
    "--preset",
    "released",
    "-tp",
    "2",
    "--text-encoder-tp-size",
    "2",
    "--vae-patch-parallel-size",
    "2",
    "--task-type",
    "fl2va",
    "--width",
    "1344",
    "--height",
    "768",
    "--diffusion-offload-config",
    '{"mode": "layer", "components": ["dit", "text_encoder"], "weight_transfer": "rank-local", "resident_layers": 20}',
]


def test_released_preset_on_two_32_gib_gpus_fits(capsys):
    assert main(["plan", *FIVE_090, "--device-memory", "32GiB"]) == 0
    out = capsys.readouterr().out
    assert "released H3 architecture" in out
    assert "rank 0: peak" in out and "rank 1: peak" in out  # rank 0 stitches the decoded tiles: they differ
    assert "in denoise" in out and "transformer stream buffers" in out and "host pinned" in out
    assert "resident DiT blocks during denoise: 20" in out
    *_, verdict, margin = out.strip().splitlines()
    assert verdict.startswith("fits: peak")
    # The margin it cannot model, from the published measurements' residuals (h3serve.offload.measured_engine).
    assert margin.startswith("unmodelled: 12 published peaks measured -5.4 ... +9.2% of their plans")
    assert "GiB above this peak (allocator fragmentation" in margin
    # The runtime overhead apart from the tensors: context, one NCCL communicator per group (world, tp, encoder
    # tp), eager here only through --enforce-eager (compiled is the CUDA default), the allocator's reserve.
    assert "runtime overhead (not tensors" in out and "nccl (3 communicators)" in out and "compile" in out
    assert "AdaLN memo store" in out and "tensors" in out and "total (as nvidia-smi)" in out


def test_released_preset_that_does_not_fit_says_by_how_much(capsys):
    assert main(["plan", *FIVE_090, "--device-memory", "16GiB", "--json"]) == 1
    captured = capsys.readouterr()
    data = json.loads(captured.out)
    assert data["fits"] is False and data["shortfall_bytes"] > 0
    assert "does not fit by" in captured.err
    assert len(data["ranks"]) == 2
    rank = data["ranks"][0]
    assert rank["peak_stage"] == "denoise"
    assert rank["peak_device_bytes"] == max(s["device_bytes"] for s in rank["stages"].values())
    assert rank["peak_tensor_bytes"] == max(s["tensor_bytes"] for s in rank["stages"].values())
    assert rank["communicators"] == ["world", "tp", "text_encoder"]
    assert rank["host_bytes"]["adaln_memo"] == 4 * 2**30  # the memo store's default bound, pinned host memory
    margin = data["unmodelled_margin"]
    assert (margin["low"], margin["high"], margin["profiles"]) == (-0.054, 0.092, 12)
    assert margin["bytes_above_peak"] == int(0.092 * data["peak_device_bytes"])
    for s in rank["stages"].values():
        assert s["device_bytes"] == s["tensor_bytes"] + sum(s["overhead"].values())
        assert set(s["overhead"]) == {"cuda_context", "nccl", "compile", "allocator_reserve"}
    assert set(rank["stages"]) == {"text_encode", "vae_encode", "denoise", "video_decode", "audio_decode"}
    assert rank["stages"]["denoise"]["stream_buffers"]["transformer"] > 0


QUARTET = ["--preset", "released", "-tp", "2", "--usp", "2", "--text-encoder-tp-size", "4",
           "--vae-patch-parallel-size", "4", "--task-type", "fl2va", "--task", "t2va", "--adaln-memo", "off"]


def test_as_vllm_omni_plans_the_measured_engine(capsys):
    """4 x RTX PRO 5000 as vLLM-Omni ran it: its conventions put the peak in the whole-video decode, where the
    recipe measured 69,219 MiB (67.60 GiB) with nvidia-smi; h3serve's own plan of the same flags peaks in denoise."""
    assert main(["plan", *QUARTET, "--as-engine", "vllm-omni", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["title"].endswith("as vllm-omni runs it")
    assert any("not how h3serve runs" in note for note in data["notes"])
    rank = data["ranks"][0]
    assert rank["peak_stage"] == "video_decode" and rank["communicators"][-1] == "sp"
    assert rank["stages"]["video_decode"]["overhead"]["retained_cache"] == rank["stages"]["denoise"]["activations"]
    assert data["peak_device_bytes"] / 2**30 == pytest.approx(66.30, abs=0.01)
    assert main(["plan", *QUARTET, "--json"]) == 0
    own = json.loads(capsys.readouterr().out)
    assert own["ranks"][0]["peak_stage"] == "denoise" and own["peak_device_bytes"] < data["peak_device_bytes"]


def test_checkpoint_json_per_rank_and_stage(tiny_checkpoint, capsys):
    assert main(["plan", str(tiny_checkpoint), "--usp", "2", "--device", "cpu", "--json", "--task", "t2va"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["fits"] is None  # no --device-memory: no verdict
    assert [r["rank"] for r in data["ranks"]] == [0, 1]
    denoise = data["ranks"][0]["stages"]["denoise"]
    assert set(denoise["weights"]) == {"transformer", "transformer_ref", "vae", "audio_vae", "text_encoder"}
    assert "text_encoder" not in data["ranks"][1]["stages"]["denoise"]["weights"]  # rank 0 runs the encoder
    assert denoise["overhead"] == {}  # CPU: no CUDA context, no NCCL
    assert denoise["modulations"] > 0  # the AdaLN memo's per-request modulations (on by default)
    parts = sum(denoise["weights"].values()) + denoise["activations"] + denoise["modulations"]
    assert parts == denoise["device_bytes"] == denoise["tensor_bytes"]


def test_human_output_names_peak_stage_and_verdict(tiny_checkpoint, capsys):
    assert main(["plan", str(tiny_checkpoint), "--enable-cpu-offload", "--device-memory", "1TiB"]) == 0
    out = capsys.readouterr().out
    assert "staged per stage" in out and "rank 0: peak" in out and "fits: peak" in out


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--preset", "bogus"], "--preset: unknown preset 'bogus'; choose from: released"),
        (["--device-memory", "lots"], "--device-memory: expected a size such as 32GiB"),
        (["-tp", "3"], "--tensor-parallel-size 3: num_attention_heads must be divisible"),
        (["--enable-cpu-offload", "--enable-layerwise-offload"], "are alternatives; choose one offload mode"),
        (
            ["--diffusion-offload-config", '{"mode": "layer", "weight_transfer": "allgather", "resident_layers": 1}'],
            "resident layers require the DiT DLO transfer to be rank-local",
        ),
        (["--dlo-no-use-allgather"], "add --enable-distributed-layerwise-offload"),
        (
            ["--diffusion-offload-config", '{"mode": "layer", "resident_layers": "auto"}'],
            "auto needs the device size; give --device-memory",
        ),
        (["--task-type", "fl2va", "--task", "ref2va"], "--task ref2va: the loaded DiTs serve t2va, fl2va"),
        (["--duration", "20"], "duration: must be between 4 and 15 seconds"),
        (["--device", "tpu"], "--device: unknown device 'tpu'"),
        (["--as-engine", "sglang"], "--as-engine: unknown engine 'sglang'; choose from: h3serve, vllm-omni"),
    ],
)
def test_refusals_name_the_fix(tiny_checkpoint, capsys, flags, message):
    assert main(["plan", str(tiny_checkpoint), *flags]) == 2
    assert message in capsys.readouterr().err


def test_model_dir_and_preset_together_are_refused(tiny_checkpoint, capsys):
    assert main(["plan", str(tiny_checkpoint), "--preset", "released"]) == 2
    assert "give MODEL_DIR or --preset, not both" in capsys.readouterr().err


def test_resident_layers_leaving_one_streamed_block_is_refused(tiny_checkpoint, capsys):
    from h3serve.checkpoint.resolver import read_layout
    from h3serve.model.transformer import H3TransformerConfig

    cfg = json.loads((read_layout(tiny_checkpoint).component("transformer") / "config.json").read_text())
    n = H3TransformerConfig.from_dict(cfg).num_layers
    flags = ["--diffusion-offload-config", json.dumps({"mode": "layer", "resident_layers": n - 1})]
    assert main(["plan", str(tiny_checkpoint), *flags]) == 2
    assert "leaves only one streaming block" in capsys.readouterr().err


def test_released_preset_with_a_real_time_session_counts_its_kv_cache(capsys):
    """The released DiT under Ulysses 4: 50 blocks x 14 heads x 128 x bf16 over the bound of rows at 480x864."""
    argv = ["plan", "--preset", "released", "--usp", "4", "--task-type", "fl2va", "--json"]
    assert main([*argv, "--realtime-lora", "taomate-h3"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert "a real-time session at 480x864" in data["title"]
    expected = 2 * 50 * kv_rows_bound(15 * 27) * 14 * 128 * 2
    assert all(s["weights"]["realtime kv cache"] == expected for s in data["ranks"][0]["stages"].values())
