"""The web page's ready examples (h3serve/api/static/examples/): per task a prompt and the files a newcomer would
otherwise have to make (and the case's duration, steps and seed), so FL2VA and Ref2VA can be tried from the page
without any.

Each example is one of `eval-demo`'s cases (`EXAMPLES`: its row and seed), its files the case's own inputs
(`evaluation.keyframe_inputs` / `reference_inputs`: keyframes of the demo world's scenes, reference images and
sounds, some as a person makes them), so what an example does is what docs/demo_world.md's tables measure. The files
are rendered by `write_examples` and shipped with the package; tests/demo/test_web_examples.py checks that the
shipped ones are what the world renders now.

    python -m h3serve.demo.web_examples h3serve/api/static/examples
"""

from __future__ import annotations

import io
import json
import sys
import wave
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from h3serve.demo.evaluation import (
    DRAWN,
    KEYFRAME_ROWS,
    REFERENCE_ROWS,
    case_attributes,
    keyframe_inputs,
    reference_inputs,
)
from h3serve.demo.shipped import DEMO_DURATION_S, DEMO_PROMPT, DEMO_STEPS
from h3serve.demo.world.grammar import prompt_for
from h3serve.rules import geometry, limits

MANIFEST = "examples.json"
CANVAS = (128, 64)  # the demo checkpoint's default canvas (width, height), which its keyframe examples are drawn on
# (row, seed) of each example. The server takes images of at least 256 px a side, so the keyframe examples are the
# `_drawn` rows' (the world's own keyframes are the 128x64 canvas's frames); each is a case the shipped weights
# (run 15) get right where its row has any (docs/demo_world.md).
EXAMPLES = (
    ("t2va", None),  # the demo's own prompt
    ("t2va", 9),
    ("fl2va_drawn", 6),
    ("fl2va_last_drawn", 2),
    ("fl2va_both_drawn", 7),
    ("ref2va", 1),
    ("ref2va_named_drawn", 3),
)


@dataclass(frozen=True)
class WebExample:
    """One ready example as the page reads it from the manifest."""

    task: str  # the page's task: t2va | fl2va | ref2va
    title: str
    prompt: str
    seconds: float
    steps: int
    seed: int  # the case's (the demo's own: 0)
    keyframes: dict[str, str]  # FL2VA: slot ("first", "last") -> file name
    references: list[str]  # Ref2VA: file names, in the order the model reads them
    case: str  # the eval-demo row and seed it is


def _png(image: np.ndarray) -> bytes:
    out = io.BytesIO()
    Image.fromarray(image).save(out, format="PNG", optimize=True)
    return out.getvalue()


def _wav(sound: np.ndarray) -> bytes:
    """16-bit PCM at 32 kHz; mono when both channels are equal (the server makes it stereo again)."""
    channels = sound[:1] if np.array_equal(sound[0], sound[1]) else sound
    pcm = np.clip(np.rint(channels.T * 32767), -32768, 32767).astype("<i2")
    out = io.BytesIO()
    with wave.open(out, "wb") as writer:
        writer.setnchannels(channels.shape[0])
        writer.setsampwidth(2)
        writer.setframerate(limits.AUDIO_SAMPLE_RATE)
        writer.writeframes(pcm.tobytes())
    return out.getvalue()


def _title(row: str, seed: int | None) -> str:
    if seed is None:
        return "Text: the demo's prompt"
    attrs = case_attributes(seed)
    what = f"{attrs.color} {attrs.shape} {attrs.motion}"
    base = row.removesuffix(DRAWN)
    drawn = " (drawn by hand)" if base != row else ""  # a reference image unlike the world's own
    if base in KEYFRAME_ROWS:
        frames = {"fl2va": "First frame", "fl2va_last": "Last frame", "fl2va_both": "First and last frames"}[base]
        return f"{frames}: a {what}"
    if base in REFERENCE_ROWS:
        sound = "image and sound" if REFERENCE_ROWS[base] else "image"
        return f"Reference {sound}{drawn}: a {attrs.shape} {attrs.motion}"
    return f"Text: a {what}"


def web_examples() -> tuple[list[WebExample], dict[str, bytes]]:
    """The examples and their files (name -> bytes)."""
    width, height = CANVAS
    frames = geometry.frames_for_duration(DEMO_DURATION_S)  # the eval cases' (107)
    examples, files = [], {}
    for row, seed in EXAMPLES:
        base = row.removesuffix(DRAWN)
        keyframes: dict[str, str] = {}
        references: list[str] = []
        if seed is None:
            task, prompt = "t2va", DEMO_PROMPT
        elif base in KEYFRAME_ROWS:
            task, prompt = "fl2va", prompt_for(case_attributes(seed))
            anchors = KEYFRAME_ROWS[base]
            images = keyframe_inputs(seed, anchors, base != row, width, height, frames)
            for anchor, image in zip(anchors, images, strict=True):
                keyframes[anchor] = name = f"{row}-{seed}-{anchor}.png"
                files[name] = _png(image)
        elif base in REFERENCE_ROWS:
            task = "ref2va"
            prompt = prompt_for(case_attributes(seed), reference_image=True, reference_sound=REFERENCE_ROWS[base])
            image, sound = reference_inputs(seed, REFERENCE_ROWS[base], base != row)
            references.append(name := f"{row}-{seed}-image.png")
            files[name] = _png(image)
            if sound is not None:
                references.append(name := f"{row}-{seed}-sound.wav")
                files[name] = _wav(sound)
        else:
            task, prompt = "t2va", prompt_for(case_attributes(seed))
        case = "make demo" if seed is None else f"eval-demo --tasks {row}, seed {seed}"
        examples.append(WebExample(task, _title(row, seed), prompt, DEMO_DURATION_S, DEMO_STEPS, seed or 0, keyframes,
                                   references, case))
    return examples, files


def manifest_text(examples: list[WebExample]) -> str:
    return json.dumps({"examples": [asdict(e) for e in examples]}, indent=1) + "\n"


def write_examples(folder: Path) -> None:
    """The manifest and the files into `folder` (created; files of earlier examples it holds are removed)."""
    folder.mkdir(parents=True, exist_ok=True)
    examples, files = web_examples()
    for old in folder.iterdir():
        if old.is_file() and old.name not in files and old.name != MANIFEST:
            old.unlink()
    for name, data in files.items():
        (folder / name).write_bytes(data)
    (folder / MANIFEST).write_text(manifest_text(examples), encoding="utf-8")


if __name__ == "__main__":
    write_examples(Path(sys.argv[1]))
