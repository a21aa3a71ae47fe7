"""The web page's ready examples: the shipped files are what the demo world renders now for their eval-demo cases,
and the server's own intake takes each of them and reads back the case's inputs."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
from PIL import Image

from h3serve.api.routes.web import STATIC_DIR
from h3serve.demo.evaluation import reference_inputs
from h3serve.demo.web_examples import EXAMPLES, MANIFEST, manifest_text, web_examples
from h3serve.demo.world import scenes as world
from h3serve.demo.world.grammar import parse_prompt
from h3serve.media.media_inputs import load_audio, load_image
from h3serve.rules.request import MediaRef

SHIPPED = STATIC_DIR / "examples"


def test_the_shipped_examples_are_what_the_world_renders_now():
    examples, files = web_examples()
    assert (SHIPPED / MANIFEST).read_text(encoding="utf-8") == manifest_text(examples)
    assert {p.name for p in SHIPPED.iterdir()} == {*files, MANIFEST}
    for name, data in files.items():
        shipped = (SHIPPED / name).read_bytes()
        if name.endswith(".png"):  # PNG bytes depend on zlib: the pixels must be equal
            assert np.array_equal(np.asarray(Image.open(io.BytesIO(shipped))), np.asarray(Image.open(io.BytesIO(data))))
        else:
            assert shipped == data, name
    assert len(examples) == len(EXAMPLES) and {e.task for e in examples} == {"t2va", "fl2va", "ref2va"}
    manifest = json.loads((SHIPPED / MANIFEST).read_text(encoding="utf-8"))["examples"]
    for example in manifest:
        parse_prompt(example["prompt"])  # the demo world's grammar
        for name in (*example["keyframes"].values(), *example["references"]):
            assert (SHIPPED / name).is_file()


def test_the_servers_intake_takes_every_example_file_and_reads_the_cases_inputs(tmp_path: Path):
    for path in sorted(SHIPPED.glob("*.png")):
        image = load_image(MediaRef(path, path.name), "input_reference").image  # >= 256 px a side, 5:2 at most
        assert np.array_equal(np.asarray(image.convert("RGB")), np.asarray(Image.open(path).convert("RGB")))
    sound = load_audio(MediaRef(SHIPPED / "ref2va-1-sound.wav", "sound.wav"), "input_reference")
    _, expected = reference_inputs(1, sound_clip=True, person_made=False)
    assert sound.sample_rate == 32000 and sound.samples.shape == (1, expected.shape[1])  # mono: the server upmixes
    assert np.abs(sound.samples[0] - expected[0]).max() <= 1 / 32767
    assert np.array_equal(expected, world.reference_audio("high beep"))
