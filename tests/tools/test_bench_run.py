"""`h3serve bench` end to end on the tiny checkpoint: one measured run per side, with the diffusers peer."""

from __future__ import annotations

import json
import re

import pytest

from h3serve.entrypoints.bench import command_line
from h3serve.entrypoints.cli import build_parser, main
from h3serve.tools.bench.matrix import load_matrix
from h3serve.tools.bench.matrix_run import SCHEMA, run_bench

STAGES = {"text_encode", "denoise", "denoise_per_step", "video_decode", "audio_decode", "mux"}


@pytest.fixture(scope="module")
def bench(tiny_checkpoint, tmp_path_factory):
    matrix = load_matrix(None, {
        "model": str(tiny_checkpoint), "shapes": ["64x32x124"], "steps": 2, "warmup": 0, "runs": 1,
        "engines": ["name=cpu,threads=2"], "peer": "diffusers", "gemm_seconds": 0.2,
    })
    out = tmp_path_factory.mktemp("bench")
    return run_bench(matrix, out, command="h3serve bench (test)", log=lambda _: None)


def test_one_run_matrix_writes_valid_records(bench):
    lines = (bench.out_dir / "runs.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert [(r["side"], r["phase"]) for r in records] == [("h3serve", "measured"), ("diffusers", "measured")]
    ours, peer = records[0], records[1]
    assert ours["schema"] == SCHEMA and ours["case"] == "t2va-64x32x124-cpu"
    assert ours["config"]["threads"] == 2 and ours["environment"]["torch_threads"] == 2
    assert ours["config"]["task_type"] == "fl2va"  # only the DiT a t2va matrix needs, as the peer loads
    assert ours["environment"]["packages"]["diffusers"] == "0.42.1"
    assert ours["request"] | {"prompt": None} == {
        "task": "t2va", "width": 64, "height": 32, "num_frames": 124, "steps": 2, "seed": 0, "prompt": None,
    }
    for r in (ours, peer):
        assert STAGES <= set(r["stages"]) and all(v >= 0 for v in r["stages"].values())
        assert r["e2e_client_s"] >= r["e2e_engine_s"] >= r["stages"]["denoise"] > 0
        assert r["dit"]["forwards"] == 2 and r["dit"]["flops"] > 0
        assert 0 < r["dit"]["fraction_of_gemm_peak"] < 2
        assert r["memory"]["peak_rss_sampled_mb"] > 100 and r["memory"]["peak_device_allocated_mb"] is None
        assert r["output"]["frames"] == 124 and len(r["output"]["raw_sha256"]) == 64
        assert r["cpu_s"] > 0 and len(r["host_load_1min"]) == 2 and r["load_s"] > 0
    # The plan beside the measured peak: h3serve's record carries the planner's prediction for this request.
    placement = ours["memory"]["placement"]
    assert placement["ranks"][0]["peak_stage"] in STAGES and placement["peak_device_bytes"] > 0
    assert ours["memory"]["planned_peak_device_mb"] == placement["peak_device_bytes"] / 2**20
    assert peer["memory"]["placement"] is None
    # Per-stage RSS: every stage the in-process engine ran, in order; the decode-and-write span starts at the
    # audio decode (full decode: audio, video, then the mux) and its peak is the highest of those stages'.
    rss = ours["memory"]["stage_rss"]
    assert list(rss["stages"])[:2] == ["text_encode", "denoise"] and {"video_decode", "mux"} <= set(rss["stages"])
    span, audio = rss["decode_write"], rss["stages"]["audio_decode"]
    assert span["start_mb"] == audio["start_mb"] and span["added_mb"] >= 0
    # Every stage's span, in start order from the request's start: the full decode's mux after its decode.
    for r in (ours, peer):
        names = [name for name, _, _ in r["timeline"]]
        assert {"text_encode", "denoise", "video_decode", "audio_decode", "mux"} <= set(names)
        assert all(0 <= start <= end <= r["e2e_engine_s"] + r["stages"]["mux"] + 1 for _, start, end in r["timeline"])
        assert [start for _, start, _ in r["timeline"]] == sorted(start for _, start, _ in r["timeline"])
    assert names[-1] == "mux"
    assert span["peak_mb"] == max(rss["stages"][s]["peak_mb"] for s in ("video_decode", "audio_decode", "mux"))
    assert list(peer["memory"]["stage_rss"]["stages"]) == ["mux"]  # the peer's own stages are not hooked
    # h3serve reproduces the reference: same arrays, bit for bit or within float noise.
    fid = ours["fidelity"]
    assert fid["reference"] == "diffusers run 0"
    assert fid["video_max_abs_diff"] <= 1e-5 and fid["audio_max_abs_diff"] <= 1e-5
    assert fid["psnr_db"] is None or fid["psnr_db"] > 90
    assert peer["fidelity"] is None
    # The text embedding runs once per request in h3serve and once per forward in diffusers.
    assert peer["dit"]["flops"] > ours["dit"]["flops"]


def test_summary_and_plots(bench):
    case = bench.summary["cases"][0]
    assert set(case["sides"]) == {"h3serve", "diffusers"}
    assert all(case["ratios_vs_peer"][k] > 0 for k in ("denoise_per_step_s", "paired_denoise_per_step_s", "cpu_s",
                                                         "paired_dit_forward_per_step_s"))
    for side in case["sides"].values():  # a step is its DiT forward plus the work outside it, both reported
        assert 0 < side["dit_forward_per_step_s"] <= side["denoise_per_step_s"]
        assert side["outside_dit_per_step_s"] >= 0
    text = bench.summary_path.read_text()
    assert "A denoise step, side by side" in text and "DiT forward" in text
    assert "t2va-64x32x124-cpu" in text and "h3serve / peer" in text and "![stages](stages.png)" in text
    assert "planned peak MB" in text and case["sides"]["h3serve"]["planned_peak_device_mb"] > 0
    assert {p.name for p in bench.plots} == {"stages.png", "step_times.png", "memory.png", "timeline.png"}
    assert "Timeline of the last measured run" in text
    assert re.search(r"- h3serve: text_encode \d+\.\d\d-\d+\.\d\d, denoise", text)
    for p in bench.plots:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 5_000
    assert not (bench.out_dir / "raw").exists()  # raw arrays are dropped unless --keep-raw


def test_bad_engine_option_fails_before_anything_starts(capsys):
    assert main(["bench", "--engine", "warp_drive=on"]) == 2
    assert "unknown engine option key(s) warp_drive" in capsys.readouterr().err


def test_command_line_is_recorded_as_typed():
    args = build_parser().parse_args(
        ["bench", "--matrix", "m.yaml", "--shape", "64x32x124", "--shape", "96x64x124", "--profile", "--prompt", "a b"]
    )
    assert command_line(args) == "h3serve bench --matrix m.yaml --shape 64x32x124 --shape 96x64x124 --prompt 'a b' " \
        "--profile"
