"""`h3serve check-demo` on MP4s of the demo world itself (rendered, H.264 + AAC): the right prompt passes, a wrong
one fails naming what it misses, a prompt outside the grammar is a usage error; `train-demo` refuses bad flags."""

from __future__ import annotations

import json

import numpy as np
import pytest

from h3serve.cli import main
from h3serve.media.mp4 import write_mp4
from h3serve.tools.demo_world import world
from h3serve.tools.demo_world.grammar import Attributes

ATTRS = Attributes("red", "ball", "bouncing", "high beep")
PROMPT = "a red ball bouncing, with a high beep"


@pytest.fixture(scope="module")
def world_mp4(tmp_path_factory):
    scene = world.sample_scene(np.random.default_rng(0), "t2va", 128, 64, 107, ATTRS)
    path = tmp_path_factory.mktemp("world") / "bounce.mp4"
    write_mp4(path, world.render_video(scene).astype(np.float32) / 255.0, world.render_audio(scene))
    return path


def test_the_worlds_own_clip_passes_its_prompt(world_mp4, capsys):
    assert main(["check-demo", str(world_mp4), "--prompt", PROMPT, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["passed"] is True and set(report["checks"]) == {"color", "motion", "pitch", "rebounds", "clicks"}


def test_a_wrong_prompt_fails_naming_what_it_misses(world_mp4, capsys):
    assert main(["check-demo", str(world_mp4), "--prompt", "a blue square moving left, with a low hum"]) == 1
    out = capsys.readouterr().out
    assert "FAIL color" in out and "FAIL pitch" in out and "FAIL motion" in out and "failed:" in out


def test_bad_input_is_one_line(world_mp4, tmp_path, capsys):
    assert main(["check-demo", str(world_mp4), "--prompt", "a red fox in the snow"]) == 2
    assert "--prompt: not a demo-world prompt" in capsys.readouterr().err
    assert main(["check-demo", str(tmp_path / "missing.mp4"), "--prompt", PROMPT]) == 2
    assert main(["train-demo", "--out", str(tmp_path / "x"), "--scale", "0"]) == 2
    assert "--scale: must be positive" in capsys.readouterr().err
