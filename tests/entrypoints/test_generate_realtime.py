"""`h3serve generate --realtime-lora DIR --duration S`: the session offline into one MP4 (whole requests, exact
frame and sample counts, deterministic per seed), and one-line refusals of what a session does not take."""

from __future__ import annotations

import hashlib

import pytest
import torch
from realtime_recorder import Recorder

from h3serve.config.engine_config import EngineConfig
from h3serve.entrypoints.cli import main
from h3serve.media.mp4 import EncoderOptions, audio_samples_for
from h3serve.media.output_probe import check_output_contract, probe
from h3serve.media.sink import Mp4Chunks
from h3serve.rank.model_runner import ModelRunner
from h3serve.rank.realtime_loop import generate_offline
from h3serve.rules import realtime_geometry as rt
from h3serve.rules.validate.realtime_plan import plan_realtime
from h3serve.tools.tiny.make_adapter import make_tiny_adapter


@pytest.fixture(scope="module")
def lora(tmp_path_factory):
    return str(make_tiny_adapter(tmp_path_factory.mktemp("cli-rt") / "taomate", "taomate"))


def _argv(checkpoint, lora, out, *extra: str) -> list[str]:
    return ["generate", "a lighthouse in a storm", "-o", str(out), "--model", str(checkpoint), "--realtime-lora", lora,
            "--width", "64", "--height", "64", "--threads", "1", *extra]


@pytest.fixture(scope="module")
def outputs(tiny_checkpoint, lora, tmp_path_factory):
    folder, threads = tmp_path_factory.mktemp("cli-rt-out"), torch.get_num_threads()
    paths = {}
    try:
        for name, seed in (("a", "3"), ("b", "3"), ("c", "4")):
            paths[name] = folder / f"{name}.mp4"
            assert main(_argv(tiny_checkpoint, lora, paths[name], "--duration", "6", "--seed", seed)) == 0
    finally:
        torch.set_num_threads(threads)
    return paths


def test_the_mp4_holds_the_whole_requests_with_exact_counts(outputs):
    result = probe(outputs["a"])
    assert check_output_contract(result) == []
    assert result.nb_frames == rt.session_frames(8) == 243  # 6 s asked: two whole requests
    # the AAC stream's duration is the video's up to its last 1024-sample frame, as every h3serve MP4's
    assert 0 <= result.audio_samples - audio_samples_for(243, 24, 32000) < 1024


def test_deterministic_per_seed(outputs):
    digest = {name: hashlib.sha256(path.read_bytes()).hexdigest() for name, path in outputs.items()}
    assert digest["a"] == digest["b"] != digest["c"]


def test_the_mp4_is_the_sessions_frames_and_audio(outputs, tiny_checkpoint, lora, tmp_path):
    """The session's chunks, written by the test through the same writer, give the CLI's bytes."""
    threads, recorder = torch.get_num_threads(), Recorder()
    try:
        engine = ModelRunner(EngineConfig(model=tiny_checkpoint, threads=1, realtime_lora=lora))
        generate_offline(engine, plan_realtime("a lighthouse in a storm", 64, 64, 3, 144, defaults=engine.defaults),
                         recorder)
    finally:
        torch.set_num_threads(threads)
    ours = Mp4Chunks(tmp_path / "ours.mp4", 243, 64, 64, EncoderOptions())  # the CLI's defaults
    for frames, audio in zip(recorder.frames, recorder.audio, strict=True):
        ours.segment(frames, audio)
    ours.finish()
    assert (tmp_path / "ours.mp4").read_bytes() == outputs["a"].read_bytes()


@pytest.mark.parametrize("extra, message", [
    (["--task", "ref2va"], "task: real-time sessions serve t2va only"),
    (["--steps", "8"], "num_inference_steps: the streaming LoRA's schedule is fixed"),
    (["--num-outputs", "2"], "num_outputs_per_prompt: a session is one stream"),
    (["--long-video"], "--long-video does not apply to a real-time session"),
    (["--duration", "601"], "--duration: a real-time session lasts more than 0 and at most 600 s"),
    (["--width", "96", "--height", "96"], "width: the short edge must be one of 64, 480, 768, 1088, got 96"),
])
def test_refusals_are_one_line(tiny_checkpoint, lora, tmp_path, capsys, extra, message):
    capsys.readouterr()
    assert main(_argv(tiny_checkpoint, lora, tmp_path / "o.mp4", *extra)) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert message in lines[-1] and not (tmp_path / "o.mp4").exists()
