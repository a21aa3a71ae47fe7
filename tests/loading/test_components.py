"""Checkpoint folders: layout resolution, defaults, lazy loading of sharded, native and diffusers weights."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from diffusers import MiniMaxH3Transformer3DModel
from safetensors.torch import load_file, save_file

from h3serve.checkpoint import native_names
from h3serve.checkpoint.file_reading import weight_keys
from h3serve.checkpoint.resolver import CheckpointError, read_layout
from h3serve.loading import dit_keys as keys
from h3serve.loading.components import load_transformer


def safe_open_keys(path):
    return weight_keys([path])


def test_layout_and_defaults_come_from_the_checkpoint(tiny_checkpoint, tmp_path):
    moved = tmp_path / "moved"
    shutil.copytree(tiny_checkpoint, moved)
    layout = read_layout(moved)
    assert layout.component("transformer") == moved / "transformer"
    assert layout.has("transformer_ref") and layout.has("audio_scheduler")
    d = layout.defaults()
    assert (d.canvas_short_edge, d.canvas_max_pixels, d.reference_image_short_edge) == (64, 8192, 64)
    assert (d.flow_shift, d.audio_flow_shift) == (12.0, 3.0)


def test_missing_index_is_a_clear_error(tmp_path):
    with pytest.raises(CheckpointError, match="modular_model_index.json"):
        read_layout(tmp_path)
    with pytest.raises(CheckpointError, match="not found"):
        read_layout(tmp_path / "nope")


@pytest.fixture(scope="module")
def reference_dit(tiny_checkpoint):
    return MiniMaxH3Transformer3DModel.from_pretrained(tiny_checkpoint / "transformer").eval()


def _same_weights(ours, ref):
    ref_sd = ref.state_dict()
    for k, v in ours.state_dict().items():
        assert torch.equal(v, ref_sd[k]), k


def test_loads_diffusers_layout_lazily(tiny_checkpoint, reference_dit):
    model = load_transformer(tiny_checkpoint / "transformer")
    _same_weights(model, reference_dit)
    assert model.rope.inv_freq.device.type == "cpu" and not model.rope.inv_freq.is_meta


def test_loads_sharded_diffusers_layout(tmp_path, tiny_checkpoint, reference_dit):
    folder = tmp_path / "sharded"
    reference_dit.save_pretrained(folder, max_shard_size="20KB")
    assert len(list(folder.glob("*.safetensors"))) > 2 and list(folder.glob("*.index.json"))
    _same_weights(load_transformer(folder), reference_dit)


@pytest.mark.parametrize("qkv_layout", ["interleaved", "stacked"])
def test_loads_native_key_names(tmp_path, tiny_checkpoint, reference_dit, qkv_layout):
    folder = tmp_path / f"native-{qkv_layout}"
    folder.mkdir()
    shutil.copy(tiny_checkpoint / "transformer" / "config.json", folder / "config.json")
    native = keys.diffusers_to_native(reference_dit.state_dict(), reference_dit.config.attention_head_dim, qkv_layout)
    names = sorted(native)
    half = len(names) // 2  # two shards with an index, as the MiniMaxAI release ships them
    save_file({k: native[k].contiguous() for k in names[:half]}, folder / "model-00001-of-00002.safetensors")
    save_file({k: native[k].contiguous() for k in names[half:]}, folder / "model-00002-of-00002.safetensors")
    weight_map = {k: f"model-0000{1 if i < half else 2}-of-00002.safetensors" for i, k in enumerate(names)}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    _same_weights(load_transformer(folder, qkv_layout=qkv_layout), reference_dit)


def test_bf16_dtype_policy(tiny_checkpoint):
    model = load_transformer(tiny_checkpoint / "transformer", dtype=torch.bfloat16)
    sd = model.state_dict()
    assert sd["proj_in.weight"].dtype == torch.float32
    assert sd["time_embedder.linear_1.weight"].dtype == torch.float32
    assert sd["audio_proj_out.bias"].dtype == torch.float32
    assert sd["context_embedder.weight"].dtype == torch.bfloat16
    assert sd["transformer_blocks.0.adaln_proj.linear.weight"].dtype == torch.bfloat16
    assert sd["norm_out.linear.weight"].dtype == torch.bfloat16


def test_wrong_shape_is_named(tmp_path, tiny_checkpoint):
    folder = tmp_path / "bad"
    shutil.copytree(tiny_checkpoint / "transformer", folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["ffn_dim"] = 80
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="ff.net.0.proj.weight.*shape"):
        load_transformer(folder)


# ------------------------------------------------------------------------------------------------------------
# Native loader edges: detection over every shard, qkv_layout, original config names, misshaped tensors by key
# ------------------------------------------------------------------------------------------------------------


def _native_folder(tmp_path, tiny_native_checkpoint):
    folder = tmp_path / "transformer"
    shutil.copytree(tiny_native_checkpoint / "FL2VA" / "transformer", folder)
    return folder


def test_native_detection_reads_every_shard_and_the_original_config_names(
    tmp_path, tiny_native_checkpoint, reference_dit
):
    folder = _native_folder(tmp_path, tiny_native_checkpoint)
    first = safe_open_keys(folder / "model-00001-of-00002.safetensors")
    assert not native_names.is_native_key_set(first)  # no marker key in the first shard
    cfg = json.loads((folder / "config.json").read_text())
    assert "ffn_hidden_size" in cfg and "latents_dim" in cfg and "ffn_dim" not in cfg
    _same_weights(load_transformer(folder), reference_dit)


def _stacked_export(tmp_path, reference_dit, metadata=None):
    folder = tmp_path / "stacked"
    folder.mkdir()
    native = keys.diffusers_to_native(reference_dit.state_dict(), reference_dit.config.attention_head_dim, "stacked")
    save_file({k: v.contiguous() for k, v in native.items()}, folder / "model.safetensors", metadata=metadata)
    return folder


def test_a_stacked_export_loads_exactly_when_its_config_says_so(tmp_path, tiny_native_checkpoint, reference_dit):
    folder = _stacked_export(tmp_path, reference_dit)
    cfg = json.loads((tiny_native_checkpoint / "FL2VA" / "transformer" / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "qkv_layout": "stacked"}))
    _same_weights(load_transformer(folder), reference_dit)
    with pytest.raises(CheckpointError, match="--qkv-layout interleaved contradicts the checkpoint config's"):
        load_transformer(folder, qkv_layout="interleaved")


def test_a_file_whose_metadata_contradicts_the_layout_is_refused(tmp_path, tiny_checkpoint, reference_dit):
    folder = _stacked_export(tmp_path, reference_dit, metadata={"qkv_layout": "stacked"})
    shutil.copy(tiny_checkpoint / "transformer" / "config.json", folder / "config.json")
    with pytest.raises(CheckpointError, match="metadata says qkv_layout='stacked' but the default gives 'interleaved'"):
        load_transformer(folder)
    _same_weights(load_transformer(folder, qkv_layout="stacked"), reference_dit)


def test_misshaped_native_tensors_name_their_checkpoint_key(tmp_path, tiny_native_checkpoint):
    folder = _native_folder(tmp_path, tiny_native_checkpoint)
    shard = folder / "model-00002-of-00002.safetensors"  # the one with blocks.0.attn.qkv_proj
    tensors = load_file(shard)
    tensors["blocks.0.attn.qkv_proj.weight"] = tensors["blocks.0.attn.qkv_proj.weight"][:-3]
    save_file(tensors, shard)
    qkv = r"key 'blocks\.0\.attn\.qkv_proj\.weight' has shape \(381, 48\), expected \(384, 48\)"
    with pytest.raises(CheckpointError, match=qkv):
        load_transformer(folder)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "ffn_hidden_size": 80}))
    fc1 = r"'(token_refiner\.)?blocks\.\d+\.mlp\.fc1\.weight' has shape \(128, 48\), expected \(160, 48\)"
    with pytest.raises(CheckpointError, match=fc1):
        load_transformer(folder)


def test_a_config_theta_that_contradicts_the_shipped_rope_table_is_refused(tmp_path, tiny_native_checkpoint):
    """The native `rope.inv_freq` is not loaded (the table is rebuilt from the config), so a config whose rope_theta
    is not the table's would rotate every token otherwise than trained: refused, naming both values."""
    folder = _native_folder(tmp_path, tiny_native_checkpoint)
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["rope_theta"] == 10000.0
    (folder / "config.json").write_text(json.dumps({**cfg, "rope_theta": 100.0}))
    with pytest.raises(CheckpointError, match=r"'rope\.inv_freq' is the RoPE table of rope_theta ≈ 1e\+04, but "
                                              r"config\.json gives rope_theta 100"):
        load_transformer(folder)


def test_contradicting_config_names_are_refused(tmp_path, tiny_native_checkpoint):
    folder = _native_folder(tmp_path, tiny_native_checkpoint)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "ffn_dim": 80}))
    with pytest.raises(CheckpointError, match="'ffn_dim' = 80 contradicts 'ffn_dim' = 64|'ffn_hidden_size'"):
        load_transformer(folder)
    (folder / "config.json").write_text(json.dumps({**cfg, "adaln_out_features": 7}))
    with pytest.raises(CheckpointError, match="'adaln_out_features' = 7 but hidden_size 48 implies 864"):
        load_transformer(folder)
