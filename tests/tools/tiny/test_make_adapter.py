"""h3serve make-tiny-adapter: deterministic synthetic adapters that pass the layout each format is read with."""

from __future__ import annotations

import hashlib

from h3serve.adapters.catalog import lora_file
from h3serve.adapters.fasth3 import read_fasth3
from h3serve.adapters.flashgen import inspect_flashgen
from h3serve.adapters.header import read_header
from h3serve.adapters.pdd import inspect_pdd, pdd_target_shapes
from h3serve.adapters.peft import target_shapes
from h3serve.adapters.turbo import parse_turbo_name
from h3serve.entrypoints.cli import main
from h3serve.tools.tiny.make_checkpoint import PRESETS


def _digest(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_each_format_is_deterministic_and_reads_back(tmp_path, capsys):
    shapes = {p: target_shapes(dict(PRESETS[p].transformer)) for p in PRESETS}
    for fmt in ("peft", "turbo", "fasth3", "pdd", "flashgen"):
        for preset in ("tiny", "cpu-bench"):
            paths = []
            for run in ("a", "b"):
                assert main(["make-tiny-adapter", str(tmp_path / fmt / preset / run), "--format", fmt,
                             "--preset", preset]) == 0
                paths.append(tmp_path / capsys.readouterr().out.strip())
            assert _digest(paths[0]) == _digest(paths[1])
            if fmt == "fasth3":
                assert read_fasth3(paths[0]).model.startswith("fastvideo/")
            elif fmt == "flashgen":  # recognised by its metadata; 5 targets per block, 4 per refiner block, final
                cfg = dict(PRESETS[preset].transformer)
                found = inspect_flashgen(read_header(paths[0]), cfg)
                assert found.contract.forwards == 4 and found.lora.rank == 4
                assert len(found.lora.keys) == 5 * cfg["num_layers"] + 4 * cfg["num_refiner_layers"] + 1
            elif fmt == "pdd":
                pdd = inspect_pdd(read_header(paths[0]), dict(PRESETS[preset].transformer))
                assert pdd.contract.forwards == 8 and len(pdd.lora.keys) == len(pdd_target_shapes(
                    dict(PRESETS[preset].transformer)))
            else:
                info = lora_file(paths[0], shapes[preset], log=lambda s: None)
                assert len(info.keys) == len(shapes[preset])
                assert (parse_turbo_name(paths[0].name) is not None) == (fmt == "turbo")
    assert main(["make-tiny-adapter", str(tmp_path / "x"), "--format", "lycoris"]) == 2
    assert "--format lycoris: choose from: peft, turbo, fasth3, pdd" in capsys.readouterr().err
