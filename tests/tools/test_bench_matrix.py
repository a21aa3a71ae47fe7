"""Bench matrix parsing: YAML and flags, engine options checked against EngineConfig, clear refusals."""

from __future__ import annotations

from pathlib import Path

import pytest

from h3serve.tools.bench.matrix import EngineSpec, MatrixError, Shape, load_matrix

REPO = Path(__file__).resolve().parents[2]


def test_sample_matrix_file_loads():
    m = load_matrix(REPO / "benchmarks" / "cpu-bench.yaml", {})
    assert m.preset == "cpu-bench" and m.peer == "diffusers" and m.reference == "peer"
    assert m.shapes == (Shape(448, 256, 124),)
    assert m.engines[0].options == {"device": "cpu", "dtype": "float32", "threads": 2}
    assert [c.id for c in m.cases()] == ["t2va-448x256x124-cpu-fp32"]


def test_flags_override_yaml_and_build_the_product(tmp_path):
    path = tmp_path / "m.yaml"
    path.write_text("runs: 5\ntasks: [t2va]\nshapes: ['64x32x22']\n")
    m = load_matrix(path, {
        "runs": 2, "tasks": ["t2va", "fl2va"], "shapes": ["64x32x22", "96x64x39"],
        "engines": ["name=a,threads=1", "threads=2,dtype=float32"], "steps": None,
    })
    assert m.runs == 2 and m.steps == 3  # None flags leave the default (3 forwards)
    assert m.reference == "first"  # auto without a peer
    assert len(m.cases()) == 2 * 2 * 2
    assert m.engines[0] == EngineSpec.parse({"name": "a", "threads": 1}, 0)
    assert m.engines[1].name == "engine1" and m.engines[1].options == {"dtype": "float32", "threads": 2}


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"engines": ["offload=cpu"]}, "engine option offload: --diffusion-offload-config: invalid JSON"),
        ({"engines": ["adaln_memo_bytes=lots"]}, "engine option adaln_memo_bytes: expected a size"),
        ({"engines": ["threads=two"]}, "engine option threads: expected an integer, got 'two'"),
        ({"engines": [{"threads": True}]}, "engine option threads: expected an integer"),
        ({"engines": ["name=x", "name=x"]}, "names must be unique"),
        ({"tasks": ["t2v"]}, "unknown task 't2v'; choose from: t2va, fl2va, ref2va"),
        ({"shapes": ["448x256"]}, "expected WIDTHxHEIGHTxFRAMES"),
        ({"shapes": [{"width": 64, "height": 32}]}, "shape: missing num_frames"),
        ({"peer": "vllm"}, "unknown peer 'vllm'"),
        ({"reference": "peer"}, "needs a peer"),
        ({"reference": "missing.mp4"}, "expected peer, first or an existing"),
        ({"runs": 0}, "runs: must be >= 1"),
        ({"steps": "4"}, "steps: expected an integer"),
        ({"colour": "red"}, "unknown matrix key(s) colour"),
    ],
)
def test_bad_matrices_are_refused_with_the_fix(overrides, message):
    with pytest.raises(MatrixError) as err:
        load_matrix(None, overrides)
    assert message in str(err.value)
    if "engine option" in message and "choose from" in message:  # the choices are EngineConfig's own fields
        assert ", dtype, " in str(err.value) and ", threads" in str(err.value) and "model" not in str(err.value)


def test_matrix_file_must_be_a_mapping(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("- just\n- a list\n")
    with pytest.raises(MatrixError, match="must hold a mapping"):
        load_matrix(path, {})
    with pytest.raises(MatrixError, match="cannot read"):
        load_matrix(tmp_path / "absent.yaml", {})


def test_the_turbo_matrix_names_its_adapter_per_engine():
    m = load_matrix(REPO / "benchmarks" / "cpu-bench-turbo.yaml", {})
    base, turbo, merged, merged_full = m.engines
    assert (base.lora, turbo.lora, merged.lora, m.steps) == (None, "turbo", "turbo", 50)
    # Every engine streams its decode into the MP4 (the server's default), but the one that shows the old order.
    assert [e.options["decode_mode"] for e in m.engines] == ["stream", "stream", "stream", "full"]
    assert merged_full.options["merge_lora"] is True
    assert turbo.options["lora_paths"] == merged.options["lora_paths"] == (("turbo", "/tmp/h3serve-turbo"),)
    assert merged.options["merge_lora"] is True and "merge_lora" not in turbo.options
    assert EngineSpec.parse("name=x,lora_paths=a=/p;b=/q,lora=b", 0).options["lora_paths"] == (("a", "/p"), ("b", "/q"))
    with pytest.raises(MatrixError, match="engine x: lora 'c' is not one of its lora_paths names"):
        EngineSpec.parse({"name": "x", "lora_paths": ["a=/p"], "lora": "c"}, 0)


def test_the_prompt_cache_is_cold_unless_the_matrix_asks_for_warm():
    assert load_matrix(None, {}).prompt_cache == "cold"
    assert load_matrix(None, {"prompt_cache": "warm"}).prompt_cache == "warm"
    with pytest.raises(MatrixError, match="prompt_cache: expected cold or warm, got 'lukewarm'"):
        load_matrix(None, {"prompt_cache": "lukewarm"})
