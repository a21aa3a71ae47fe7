"""The one checkpoint resolver: modular root, native FL2VA/Ref2VA root, one variant folder, both kinds at once,
and every refusal (half-downloaded shards, a missing variant, a dangling wrapper config, audio metadata/config
disagreement) with its message. Torch-free: only files are read."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from h3serve.checkpoint.resolver import CheckpointError, read_layout


@pytest.fixture
def native(tiny_native_checkpoint, tmp_path) -> Path:
    root = tmp_path / "MiniMax-H3"
    shutil.copytree(tiny_native_checkpoint, root)
    return root


def _edit_json(path: Path, **changes) -> None:
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


def test_native_root_serves_both_variants_with_shared_components_once(native):
    layout = read_layout(native)
    assert layout.kind == "native"
    assert layout.component("transformer") == native / "FL2VA" / "transformer"
    assert layout.component("transformer_ref") == native / "Ref2VA" / "transformer"
    for name, folder in (("vae", "video_vae"), ("audio_vae", "audio_vae"), ("text_encoder", "text_encoder")):
        assert layout.component(name) == native / "FL2VA" / folder  # Ref2VA/ holds only its DiT
    assert layout.is_native("vae") and layout.is_native("audio_vae")
    d = layout.defaults()
    assert (d.flow_shift, d.audio_flow_shift, d.canvas_short_edge) == (12.0, 3.0, 64)  # sigma_shift_scales


def test_native_and_modular_configs_agree(native, tiny_checkpoint):
    ours, theirs = read_layout(native), read_layout(tiny_checkpoint)
    for name in ("transformer", "transformer_ref", "vae", "audio_vae"):
        a = {k: v for k, v in ours.component_config(name).items() if not k.startswith("_")}
        b = {k: v for k, v in theirs.component_config(name).items() if not k.startswith("_")}
        assert json.loads(json.dumps(a)) == {k: json.loads(json.dumps(v)) for k, v in b.items() if k in a}, name
        assert set(a) == {k for k in b if k != "_use_default_values"}, name


def test_a_single_variant_folder_and_task_type_selection(native):
    fl2va = read_layout(native / "FL2VA")
    assert fl2va.has("transformer") and not fl2va.has("transformer_ref")
    shutil.copytree(native / "FL2VA", native / "copy", ignore=shutil.ignore_patterns("transformer"))
    shutil.copytree(native / "Ref2VA" / "transformer", native / "copy" / "transformer")
    _edit_json(native / "copy" / "model_index.json", _minimax_h3={"partition": "ref2va", "tasks": ["ref2va"]})
    ref = read_layout(native / "copy")  # a Ref2VA variant with its own copies of the shared components
    assert ref.has("transformer_ref") and ref.component("vae") == native / "copy" / "video_vae"
    only_ref = read_layout(native, ("transformer_ref",))
    assert not only_ref.has("transformer") and only_ref.component("text_encoder") == native / "FL2VA" / "text_encoder"
    with pytest.raises(CheckpointError, match="needs the Ref2VA variant; this tree has FL2VA"):
        read_layout(native / "FL2VA", ("transformer_ref",))


def test_half_downloaded_shards_are_named(native):
    (native / "Ref2VA" / "transformer" / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"Ref2VA/transformer: 1 of 2 shards present \(missing: model-00002"):
        read_layout(native)
    assert read_layout(native, ("transformer",)).has("transformer")  # --task-type fl2va does not need Ref2VA


def test_a_missing_shared_component_and_a_missing_index_are_named(native):
    shutil.rmtree(native / "FL2VA" / "processor")
    (native / "Ref2VA" / "model_index.json").unlink()
    with pytest.raises(CheckpointError) as e:
        read_layout(native)
    assert "Ref2VA: no model_index.json with a _minimax_h3 block" in str(e.value)
    looked = r"processor: not found \(looked in FL2VA/processor, Ref2VA/processor, MiniMax-H3/processor\)"
    with pytest.raises(CheckpointError, match=looked):
        read_layout(native, ("transformer",))


def test_wrapper_config_pointing_at_a_missing_source_file(native):
    _edit_json(native / "FL2VA" / "video_vae" / "config.json", source_safetensors_path="gone.safetensors")
    with pytest.raises(CheckpointError, match="source_path/source_safetensors_path name .*gone.safetensors"):
        read_layout(native)


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("latent_channels", 16, "latent width disagreement: metadata.json says 32, config.json says 16"),
        ("sample_rate", 16000, "sample rate disagreement: metadata.json says 32000, config.json says 16000"),
    ],
)
def test_audio_vae_metadata_and_config_must_agree(native, field, value, message):
    _edit_json(native / "FL2VA" / "audio_vae" / "config.json", **{field: value})
    with pytest.raises(CheckpointError, match=message):
        read_layout(native)


def test_partition_must_match_the_folder(native):
    _edit_json(native / "Ref2VA" / "model_index.json", _minimax_h3={"partition": "fl2va"})
    with pytest.raises(CheckpointError, match="partition is 'fl2va', expected 'ref2va' for the Ref2VA variant"):
        read_layout(native)


def test_a_root_with_both_kinds_serves_the_modular_layout_and_says_so(native, tiny_checkpoint):
    for item in tiny_checkpoint.iterdir():
        if not (native / item.name).exists():  # the tiny marker file is in both
            (native / item.name).symlink_to(item)
    said: list[str] = []
    layout = read_layout(native, log=said.append)
    assert layout.kind == "modular" and layout.component("vae") == native / "vae"
    assert "serving the modular one" in said[0]
    (native / "transformer_ref").unlink()  # the converted Ref2VA DiT not downloaded: the native tree serves
    said.clear()
    layout = read_layout(native, log=said.append)
    assert layout.kind == "native" and "modular layout is incomplete (transformer_ref" in said[0]


def test_not_a_checkpoint(tmp_path):
    with pytest.raises(CheckpointError, match="no modular_model_index.json .* no FL2VA/ or Ref2VA/"):
        read_layout(tmp_path)
