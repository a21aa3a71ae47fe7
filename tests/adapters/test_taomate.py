"""The TaoMate-H3 streaming LoRA directory: the tiny writer's output reads back, and every break of the released
contract (inventory, shapes, config) is refused with the file and the problem named."""

from __future__ import annotations

import hashlib
import json

import pytest

from h3serve.adapters.header import AdapterError
from h3serve.adapters.taomate import WEIGHTS_FILE, diffusers_parts, inspect_taomate, is_taomate_dir, native_targets
from h3serve.entrypoints.cli import main
from h3serve.tools.tiny.make_adapter import save_file, write_taomate_adapter
from h3serve.tools.tiny.make_checkpoint import PRESETS

TINY = dict(PRESETS["tiny"].transformer)


def test_make_tiny_adapter_taomate_writes_the_released_layout_and_reads_back(tmp_path, capsys):
    digests = []
    for run in ("a", "b"):
        assert main(["make-tiny-adapter", str(tmp_path / run), "--format", "taomate"]) == 0
        folder = tmp_path / capsys.readouterr().out.strip()
        digests.append(hashlib.sha256((folder / WEIGHTS_FILE).read_bytes()).hexdigest())
    assert digests[0] == digests[1]
    assert json.loads((folder / "config.json").read_text()) == {"alpha": 4.0, "rank": 4}
    info = inspect_taomate(folder, TINY)
    assert is_taomate_dir(folder) and (info.rank, info.alpha, info.unit_scale) == (4, 4.0, 1.0)
    blocks = TINY["num_layers"] + TINY["num_refiner_layers"]
    assert len(info.keys) == 4 * blocks
    assert info.keys["token_refiner.blocks.0.attn.qkv_proj"] == (
        "token_refiner.blocks.0.attn.qkv_proj.lora_a", "token_refiner.blocks.0.attn.qkv_proj.lora_b")
    assert list(info.keys)[:5] == list(native_targets(TINY["num_layers"], 1))[:5]


def test_native_targets_map_onto_the_diffusers_modules():
    qkv = diffusers_parts("blocks.3.attn.qkv_proj", 384)
    assert [(p.target, p.start, p.stop) for p in qkv] == [
        ("transformer_blocks.3.attn.to_q", 0, 128), ("transformer_blocks.3.attn.to_k", 128, 256),
        ("transformer_blocks.3.attn.to_v", 256, 384)]
    (fc1,) = diffusers_parts("token_refiner.blocks.1.mlp.fc1", 128)
    assert (fc1.target, fc1.swap_halves) == ("token_refiner.refiner_blocks.1.ff.net.0.proj", True)
    assert diffusers_parts("blocks.0.attn.out_proj", 48)[0].target == "transformer_blocks.0.attn.to_out.0"
    assert diffusers_parts("blocks.0.mlp.fc2", 48)[0].target == "transformer_blocks.0.ff.net.2"


@pytest.mark.parametrize(
    "break_it, message",
    [
        (lambda d: (d / "config.json").unlink(), "no config.json or adapter_config.json"),
        (lambda d: (d / "config.json").write_text('{"rank": 0, "alpha": 4}'), "the rank (rank or r) must be"),
        (lambda d: (d / "config.json").write_text('{"rank": 8, "alpha": 4}'), "expected [8, 48] (rank 8"),
        (lambda d: (d / "config.json").write_text('{"r": 4}'), "alpha (alpha or lora_alpha) must be"),
        (lambda d: (d / "config.json").write_text("[1]"), "must hold a JSON object"),
        (lambda d: (d / WEIGHTS_FILE).unlink(), "no adapter_model.safetensors"),
    ],
)
def test_broken_directories_are_refused(tmp_path, break_it, message):
    folder = write_taomate_adapter(tmp_path / "a", TINY)
    break_it(folder)
    with pytest.raises(AdapterError, match=None) as err:
        inspect_taomate(folder, TINY)
    assert message in str(err.value)


def test_inventory_and_shapes_are_checked(tmp_path):
    import torch
    from safetensors.torch import load_file

    folder = write_taomate_adapter(tmp_path / "a", TINY)
    tensors = load_file(str(folder / WEIGHTS_FILE))
    for edit, message in (
        (lambda t: t.pop("blocks.5.mlp.fc2.lora_b"), "lacks blocks.5.mlp.fc2.lora_b (1 missing, 0 unexpected"),
        (lambda t: t.update({"blocks.6.mlp.fc2.lora_a": torch.zeros(4, 64)}), "unexpected tensor 'blocks.6.mlp.fc2"),
        (lambda t: t.update({"blocks.0.attn.qkv_proj.lora_b": torch.zeros(96, 4)}), "expected [384, 4]"),
    ):
        broken = dict(tensors)
        edit(broken)
        save_file(broken, str(folder / WEIGHTS_FILE))
        with pytest.raises(AdapterError) as err:
            inspect_taomate(folder, TINY)
        assert message in str(err.value)
    with pytest.raises(AdapterError, match="is a directory"):
        inspect_taomate(folder / WEIGHTS_FILE, TINY)
    assert not is_taomate_dir(tmp_path)
