"""`make-tiny-checkpoint --layout native`: deterministic, the modular checkpoint's weights in the native layout;
loaded in place it yields the very modules the modular one does, and `h3serve plan` reads it the same way."""

from __future__ import annotations

import hashlib
import json

import torch

from h3serve.checkpoint.resolver import read_layout
from h3serve.entrypoints.cli import main
from h3serve.loading.components import load_components


def _digests(root) -> dict[str, str]:
    files = (p for p in root.rglob("*") if p.is_file())
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


def test_cli_build_is_deterministic_and_the_modular_twin(tiny_native_checkpoint, tmp_path, capsys):
    assert main(["make-tiny-checkpoint", str(tmp_path / "n"), "--layout", "native", "--seed", "0"]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "n")
    # drawn from the seed here, read back from the modular checkpoint in the fixture: the same bytes
    assert _digests(tmp_path / "n") == _digests(tiny_native_checkpoint)
    assert main(["make-tiny-checkpoint", str(tmp_path / "x"), "--layout", "flat"]) != 0


def test_native_components_equal_the_modular_ones(tiny_native_checkpoint, tiny_checkpoint):
    native = load_components(read_layout(tiny_native_checkpoint))
    modular = load_components(read_layout(tiny_checkpoint))
    for name in ("transformer", "transformer_ref", "vae", "audio_vae"):
        ours, theirs = getattr(native, name).state_dict(), getattr(modular, name).state_dict()
        assert ours.keys() == theirs.keys(), name
        for key, value in theirs.items():
            assert value.dtype == ours[key].dtype and torch.equal(value, ours[key]), (name, key)
    assert (native.vae.tile_sample_min_height, native.vae.tile_sample_min_overlap_width) == (
        modular.vae.tile_sample_min_height,
        modular.vae.tile_sample_min_overlap_width,
    )
    text_native, text_modular = native.text.model.state_dict(), modular.text.model.state_dict()
    assert all(torch.equal(v, text_native[k]) for k, v in text_modular.items())
    assert native.vision_config == modular.vision_config


def test_plan_reads_a_native_tree_as_the_modular_one(tiny_native_checkpoint, tiny_checkpoint, capsys):
    reports = []
    for root in (tiny_native_checkpoint, tiny_checkpoint):
        assert main(["plan", str(root), "--usp", "2", "--device", "cpu", "--json", "--task", "t2va"]) == 0
        reports.append(json.loads(capsys.readouterr().out))
    assert reports[0]["ranks"] == reports[1]["ranks"]
