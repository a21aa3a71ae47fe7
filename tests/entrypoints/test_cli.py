"""`h3serve generate` end to end: output contract, determinism, raw arrays, and one-line errors."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys

import numpy as np
import pytest

from h3serve.entrypoints.cli import main


def _run(*args: str) -> subprocess.CompletedProcess:
    """The real entry point in its own process."""
    return subprocess.run([sys.executable, "-m", "h3serve", *args], capture_output=True, text=True, timeout=600)


def _refused(capsys, *args: str) -> str:
    """`main(args)` in this process (no interpreter start-up per case): it must exit non-zero; its stderr."""
    capsys.readouterr()
    try:
        code = main(list(args))
    except SystemExit as e:  # argparse's own refusals
        code = e.code
    assert code not in (0, None)
    return capsys.readouterr().err


def _ffprobe(path) -> dict:
    out = subprocess.run(
        ["ffprobe", "-v", "error", "-count_frames", "-show_streams", "-of", "json", str(path)],
        capture_output=True,
        text=True,
        check=True,
    )
    return {s["codec_type"]: s for s in json.loads(out.stdout)["streams"]}


def _sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def outputs(tiny_checkpoint, tmp_path_factory):
    """Three runs with --save-raw (a full decode): seed 3 twice (5 s), seed 4 once (4 s); and seed 3 again
    without it, streamed (the default --decode-mode)."""
    d = tmp_path_factory.mktemp("cli")
    runs = {}
    for name, seed, seconds in (("a", 3, 5), ("b", 3, 5), ("c", 4, 4)):
        mp4, raw = d / f"{name}.mp4", d / f"{name}.npz"
        argv = ["generate", "a lighthouse in a storm", "-o", str(mp4), "--model", str(tiny_checkpoint)]
        argv += ["--duration", str(seconds), "--steps", "2", "--seed", str(seed), "--save-raw", str(raw)]
        assert main(argv) == 0
        runs[name] = (mp4, raw)
    streamed = d / "streamed.mp4"
    argv = ["generate", "a lighthouse in a storm", "-o", str(streamed), "--model", str(tiny_checkpoint)]
    assert main([*argv, "--duration", "5", "--steps", "2", "--seed", "3"]) == 0
    runs["streamed"] = (streamed, None)
    return runs


@pytest.mark.parametrize("name, frames", [("a", 124), ("c", 107)])
def test_output_contract(outputs, name, frames):
    mp4, _ = outputs[name]
    streams = _ffprobe(mp4)
    v, a = streams["video"], streams["audio"]
    assert (v["codec_name"], v["pix_fmt"], v["r_frame_rate"]) == ("h264", "yuv420p", "24/1")
    assert int(v["nb_read_frames"]) == frames
    assert (a["codec_name"], int(a["sample_rate"]), int(a["channels"])) == ("aac", 32000, 2)
    assert abs(float(a["duration"]) - frames / 24) < 0.05
    decode = subprocess.run(["ffmpeg", "-v", "error", "-i", str(mp4), "-f", "null", "-"], capture_output=True)
    assert decode.returncode == 0 and decode.stderr == b""


def test_same_seed_is_byte_identical_and_other_seed_differs(outputs):
    (a_mp4, a_raw), (b_mp4, b_raw), (c_mp4, c_raw) = outputs["a"], outputs["b"], outputs["c"]
    assert _sha(a_mp4) == _sha(b_mp4) and _sha(a_raw) == _sha(b_raw)
    assert _sha(a_mp4) != _sha(c_mp4)
    with np.load(a_raw) as ra, np.load(c_raw) as rc:
        assert ra["video"].shape[0] == 124 and rc["video"].shape[0] == 107
        assert not np.array_equal(ra["video"][:107], rc["video"])


def test_streamed_decode_writes_the_full_decodes_bytes(outputs):
    assert _sha(outputs["streamed"][0]) == _sha(outputs["a"][0])


def test_raw_arrays_are_what_went_into_the_mp4(outputs):
    _, raw = outputs["a"]
    with np.load(raw) as r:
        video, audio = r["video"], r["audio"]
        assert video.dtype == np.float32 and video.shape == (124, 64, 128, 3)
        assert 0.0 <= video.min() and video.max() <= 1.0
        assert audio.dtype == np.float32 and audio.shape == (2, 207 * 800)
        assert int(r["fps"]) == 24 and int(r["sample_rate"]) == 32000


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--duration", "3.9"], "duration: must be between 4 and 15 seconds"),
        (["--duration", "15.5"], "duration: must be between 4 and 15 seconds"),
        (["--width", "100", "--height", "64"], "width: must be a multiple of 32"),
        (["--width", "160", "--height", "32"], "1:4 to 4:1"),
        (["--steps", "0"], "steps: must be between 1 and 200"),
        (["--aspect-ratio", "5:1"], "aspect_ratio"),
        (["--image", "/nonexistent.png"], "image"),
        (["--flow-shift", "1e6"], "flow_shift: must be greater than 0 and at most 100"),
        (["--sample-solver", "heun"], "sample_solver: must be one of euler, res_multistep, got 'heun'"),
        (["--crf", "99"], "crf"),
        (["--long-video", "--duration", "31"], "duration: must be between 4 and 30 seconds (long_video_mode=full)"),
        (["--video-noise-mask", "[0.5"], "--video-noise-mask: contains invalid JSON or is nested too deeply"),
        (["--save-raw", "/nonexistent-dir/raw.npz"], "--save-raw: folder /nonexistent-dir does not exist"),
        (["--diffusion-attention-config", '{"default": "FLASH_ATTN"}'], "--diffusion-attention-config: default"),
    ],
)
def test_bad_input_is_one_line_and_nonzero(tiny_checkpoint, tmp_path, capsys, extra, message):
    err = _refused(capsys, "generate", "x", "-o", str(tmp_path / "o.mp4"), "--model", str(tiny_checkpoint), *extra)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in err
    assert not (tmp_path / "o.mp4").exists()


def test_empty_and_long_prompts_are_refused(tiny_checkpoint, tmp_path, capsys):
    for prompt, message in (("", "prompt: must not be empty"), ("x" * 7001, "the limit is 7000")):
        err = _refused(capsys, "generate", prompt, "-o", str(tmp_path / "o.mp4"), "--model", str(tiny_checkpoint))
        assert message in err


def test_unwritable_output_is_refused_before_generating(tiny_checkpoint, tmp_path):
    """Through the real entry point: exit status and stderr of the process itself."""
    r = _run("generate", "x", "-o", str(tmp_path / "missing" / "o.mp4"), "--model", str(tiny_checkpoint))
    assert r.returncode != 0 and "--output: folder" in r.stderr and "does not exist" in r.stderr
    assert "denoise" not in r.stderr  # refused before any weight was read


def test_sample_solver_flag_reaches_the_request():
    from h3serve.entrypoints.cli import build_parser
    from h3serve.entrypoints.generate import _request_from_args
    from h3serve.rules.validate import validate

    args = build_parser().parse_args(["generate", "x", "-o", "o.mp4", "--sample-solver", " RES_Multistep"])
    assert validate(_request_from_args(args)).sample_solver == "res_multistep"
    args = build_parser().parse_args(["generate", "x", "-o", "o.mp4"])
    request = _request_from_args(args)
    assert request.sample_solver is None and validate(request).sample_solver == "euler"


def test_several_outputs_are_each_their_single_run(outputs, tiny_checkpoint, tmp_path, capsys):
    """--num-outputs 2 from seed 2, streamed: out.mp4 is seed 2's video, out.1.mp4 exactly seed 3's (run `a`)."""
    out = tmp_path / "out.mp4"
    argv = ["generate", "a lighthouse in a storm", "-o", str(out), "--model", str(tiny_checkpoint)]
    assert main([*argv, "--duration", "5", "--steps", "2", "--seed", "2", "--num-outputs", "2"]) == 0
    assert capsys.readouterr().out.split() == [str(out.resolve()), str((tmp_path / "out.1.mp4").resolve())]
    assert _sha(tmp_path / "out.1.mp4") == _sha(outputs["a"][0])
    assert _sha(out) != _sha(outputs["a"][0])


def test_the_summary_line_says_when_each_stage_ran():
    from h3serve.entrypoints.generate import format_stages

    durations = {"text_encode": 0.5, "denoise": 4.0, "denoise_per_step": 1.0, "audio_decode": 0.5,
                 "video_decode": 1.0, "mux": 1.25}
    timeline = [(100.0 + a, 100.0 + b) for a, b in ((0, 0.5), (0.5, 4.5), (4.5, 5.0), (5.0, 6.0), (5.25, 6.5))]
    spans = [(name, a, b) for name, (a, b) in zip(("text_encode", "denoise", "audio_decode", "video_decode", "mux"),
                                                  timeline, strict=True)]
    line = format_stages(durations, spans)
    assert line == ("text_encode 0.50s @0.00-0.50 | denoise 4.00s (1.000s/step) @0.50-4.50 | audio_decode 0.50s "
                    "@4.50-5.00 | video_decode 1.00s @5.00-6.00 | mux 1.25s @5.25-6.50")  # the encode overlaps
    assert format_stages({"denoise": 2.0}) == "denoise 2.00s"


def _guide_files(folder):
    from PIL import Image

    image = folder / "guide.png"
    Image.new("RGB", (96, 64), (220, 40, 40)).save(image)
    tone = folder / "tone.wav"
    samples = (8000 * np.sin(2 * np.pi * 440 * np.arange(16_000) / 32_000)).astype("<i2")
    import wave

    with wave.open(str(tone), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(32_000)
        w.writeframes(samples.tobytes())
    return image, tone


def test_guide_flags_become_timeline_guides_counted_from_either_end(tmp_path):
    from h3serve.entrypoints.cli import build_parser
    from h3serve.entrypoints.generate import _request_from_args, joined_guides

    image, tone = _guide_files(tmp_path)
    argv = joined_guides(["generate", "x", "-o", "o.mp4", "--guide", "-1=" + str(image), "--guide", f"36={tone}"])
    request = _request_from_args(build_parser().parse_args(argv))
    first, second = request.guides
    assert (first.frame_index, first.visual.kind, first.audio) == (-1, "image", None)
    assert (second.frame_index, second.visual, second.audio.kind) == (36, None, "audio")


def test_generate_with_guides_writes_the_mp4_and_refuses_a_guide_outside_the_output(tiny_checkpoint, tmp_path,
                                                                                      capsys):
    image, tone = _guide_files(tmp_path)
    mp4 = tmp_path / "guided.mp4"
    argv = ["generate", "a lighthouse", "-o", str(mp4), "--model", str(tiny_checkpoint), "--duration", "4",
            "--width", "64", "--height", "32", "--steps", "1", "--guide", "-1=" + str(image), "--guide", f"36={tone}"]
    assert main(argv) == 0
    streams = _ffprobe(mp4)
    assert int(streams["video"]["nb_read_frames"]) == 107 and streams["audio"]["sample_rate"] == "32000"
    err = _refused(capsys, *argv[:-4], "--guide", f"107={image}")
    assert "timeline_guides[0].frame_index: 107 places" in err and len(err.strip().splitlines()) == 1
    err = _refused(capsys, *argv[:-4], "--guide", "frame=x.png")
    assert "--guide: expects INDEX=FILE" in err
