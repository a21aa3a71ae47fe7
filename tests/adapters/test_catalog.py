"""The torch-free adapter checks: the request field, the allow-listed root, the PEFT layout and Turbo's contract."""

from __future__ import annotations

import builtins
import dataclasses
import io
import os

import pytest
from small_dit import SMALL_DIT

from h3serve.adapters.catalog import LoraCatalog, LoraField, parse_lora_field
from h3serve.adapters.header import AdapterError, read_header
from h3serve.adapters.peft import inspect_lora, target_shapes
from h3serve.adapters.turbo import parse_turbo_name
from h3serve.model.transformer import H3TransformerConfig
from h3serve.rules.adapter_choice import turbo_pin
from h3serve.rules.request import GenerationRequest
from h3serve.rules.validate import ModelDefaults, RequestError, validate
from h3serve.tools.tiny.make_adapter import lora_tensors, write_peft_adapter, write_turbo_adapter

CFG = dataclasses.asdict(H3TransformerConfig(**SMALL_DIT))
SHAPES = target_shapes(CFG)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    folder = tmp_path_factory.mktemp("adapters")
    write_peft_adapter(folder / "style", CFG, rank=4, alpha=8.0, seed=1)
    write_turbo_adapter(folder / "turbo", CFG, rank=8)
    return folder


def test_the_request_field_takes_vllm_omnis_names_and_refuses_the_rest():
    assert parse_lora_field({"lora_name": "a", "lora_scale": 0.5, "lora_int_id": 3}) == LoraField("a", None, 0.5, 3)
    assert parse_lora_field({"adapter": "a", "local_path": "x/y"}) == LoraField("a", "x/y", None, None)
    assert parse_lora_field(None) is None and parse_lora_field({}) is None
    for value, message in (
        ({"nme": "a"}, "lora: unknown keys nme"),
        ({"scale": 1.0}, "lora: give a name"),
        ({"name": "a", "scale": 11}, "lora.scale: must be between -10 and 10, got 11"),
        ({"name": "a", "scale": True}, "lora.scale: must be a number"),
        ({"name": "a", "int_id": -1}, "lora.int_id: must be an integer from 0 to"),
        ({"name": "a", "int_id": 2**63}, "lora.int_id: must be an integer from 0 to"),
        ({"name": "a", "int_id": 10**5000}, "lora.int_id: .*got an integer of about 5,001 digits"),
        ({"name": "a", "lora_name": "b"}, "lora: name and lora_name disagree"),
        ("a", "lora: must be an object"),
    ):
        with pytest.raises(RequestError, match=message):
            parse_lora_field(value)


def test_preloaded_names_scales_and_listing(root):
    catalog = LoraCatalog(SHAPES, {"style": str(root / "style")}, default_scale=0.8, log=lambda s: None)
    choice = catalog.choose(LoraField(name="style"))
    assert (choice.rank, choice.alpha, choice.scale) == (4, 8.0, 0.8)
    assert catalog.choose(LoraField(name="style", scale=0.3)).scale == 0.3
    with pytest.raises(RequestError, match="lora.name: unknown adapter 'x'; preloaded: style"):
        catalog.choose(LoraField(name="x"))
    with pytest.raises(RequestError, match="started without --lora-dir"):
        catalog.choose(LoraField(path="style/adapter_model.safetensors"))
    [card] = catalog.models("tiny", 1)
    assert card["id"] == "style" and card["parent"] == "tiny" and card["lora"]["rank"] == 4
    assert catalog.slot_rank == 4


def _no_open(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError(f"a file was opened: {args[:1]}")

    monkeypatch.setattr(builtins, "open", refuse)
    monkeypatch.setattr(io, "open", refuse)
    monkeypatch.setattr(os, "open", refuse)


def test_request_paths_stay_inside_the_root_and_bad_ones_are_never_opened(root, tmp_path, monkeypatch):
    outside = write_peft_adapter(tmp_path / "outside", CFG, rank=4, seed=3)
    (root / "link").symlink_to(outside.parent, target_is_directory=True)
    catalog = LoraCatalog(SHAPES, root=root, log=lambda s: None)
    assert catalog.choose(LoraField(path="style")).path == str(root / "style" / "adapter_model.safetensors")
    assert catalog.slot_rank == 128
    _no_open(monkeypatch)
    for path, message in (
        ("../outside/adapter_model.safetensors", "must not contain '..'"),
        ("style/../../outside", "must not contain '..'"),
        (str(outside), "outside the adapter directory"),
        ("link/adapter_model.safetensors", "outside the adapter directory"),
        ("/etc/passwd", "outside the adapter directory"),
        ("a" * 300, "a path component is 300 bytes"),  # issue 54: ENAMETOOLONG from is_dir, an HTTP 500
        ("style/" + "b" * 256 + "/x.safetensors", "a path component is 256 bytes"),
    ):
        with pytest.raises(RequestError, match=message) as err:
            catalog.choose(LoraField(path=path))
        assert err.value.field == "lora.path"
    no_root = LoraCatalog(SHAPES, {}, log=lambda s: None)
    with pytest.raises(RequestError, match="serves no LoRA adapters"):
        no_root.choose(LoraField(path=str(outside)))


def _write(tmp_path, tensors, name="adapter_model.safetensors", metadata=None):
    from safetensors.torch import save_file

    path = tmp_path / name
    save_file(tensors, str(path), metadata=metadata)
    return read_header(path)


def test_unknown_or_misshaped_targets_are_refused_naming_the_key(tmp_path):
    good = lora_tensors(CFG, rank=2, seed=0, targets=["transformer_blocks.0.attn.to_q"])
    header = _write(tmp_path, good)
    info = inspect_lora(header, SHAPES)
    assert info.rank == 2 and info.alpha == 2.0 and info.alpha_source == "default"
    a = good["transformer_blocks.0.attn.to_q.lora_A.weight"]
    cases = [
        ({"transformer_blocks.0.norm1.lora_A.weight": a}, "targets 'transformer_blocks.0.norm1', which is not a LoRA"),
        ({"transformer_blocks.9.attn.to_q.lora_A.weight": a}, "'transformer_blocks.9.attn.to_q', which is not"),
        ({"transformer_blocks.0.attn.to_out.0.lora_A.weight": a}, r"has shape \[2, 48\], expected \[r, 64\]"),
        ({"transformer_blocks.0.attn.to_q.lora_A.weight": a}, "has no lora_B tensor"),
        ({"transformer_blocks.0.attn.to_q.weight": a}, "is not a lora_A/lora_B weight"),
    ]
    for tensors, message in cases:
        with pytest.raises(AdapterError, match=message):
            inspect_lora(_write(tmp_path, tensors, "bad.safetensors"), SHAPES)
    (tmp_path / "adapter_config.json").write_text('{"r": 2, "lora_alpha": 6}')
    assert inspect_lora(_write(tmp_path, good), SHAPES).alpha == 6.0


def test_turbo_names_are_the_contract(root, tmp_path):
    c = parse_turbo_name("minimax_h3_fl2v_turbo_4step_v1.0.safetensors")
    assert (c.tasks, c.forwards, c.flow_shift, c.audio_flow_shift) == (("t2va", "fl2va"), 4, 12.0, 3.0)
    c768 = parse_turbo_name("minimax_h3_ref2v_turbo_8step_v2.1_768p_bf16.safetensors")
    assert (c768.tasks, c768.forwards, c768.flow_shift, c768.version) == (("ref2va",), 8, 6.0, "2.1")
    assert parse_turbo_name("minimax_h3_t2v_turbo_4step_v1.0.safetensors") is None
    assert parse_turbo_name("minimax_h3_fl2v_turbo_4step_v1.safetensors") is None
    lines: list[str] = []
    catalog = LoraCatalog(SHAPES, {"turbo": str(root / "turbo")}, log=lines.append)
    choice = catalog.choose(LoraField(name="turbo"))
    assert choice.turbo == c and choice.alpha == 8.0 and choice.rank == 8
    assert lines == [f"warning: {c.file_name}: no alpha in its metadata; using LightX2V's default alpha 8"]
    plan = validate(GenerationRequest(prompt="x", lora=choice))
    assert (plan.steps, plan.flow_shift, plan.audio_flow_shift, plan.pinned_positions) == (4, 12.0, 3.0, None)
    assert validate(GenerationRequest(prompt="x", lora=choice, steps=4, flow_shift=12.0)).steps == 4
    owner = r"the 4-step Turbo adapter turbo \(minimax_h3_fl2v_turbo_4step_v1.0.safetensors\)"
    for fields, field, message in (
        ({"steps": 50}, "steps", owner + " runs exactly 4 steps .* got 50"),
        ({"flow_shift": 6.0}, "flow_shift", owner + r" runs at flow_shift 12 \(4 steps\); omit the field or send 12"),
        ({"audio_flow_shift": 5.0}, "audio_flow_shift", "runs at audio_flow_shift 3"),
    ):
        with pytest.raises(RequestError, match=message) as err:
            validate(GenerationRequest(prompt="x", lora=choice, **fields))
        assert err.value.field == field
    with pytest.raises(RequestError, match=r"turbo \(minimax_h3_fl2v.*\) serves t2va, fl2va, not ref2va") as err:
        turbo_pin(c, "turbo", "ref2va")
    assert err.value.field == "lora"
    pin = turbo_pin(c768, "t", "ref2va")
    assert (pin.steps, pin.flow_shift, pin.audio_flow_shift) == (8, 6.0, 3.0)
    with pytest.raises(RequestError, match="flow_shift 6"):  # a 768p file with the default 12 stated
        validate(GenerationRequest(prompt="x", lora=dataclasses.replace(choice, turbo=parse_turbo_name(
            "minimax_h3_fl2v_turbo_4step_v1.0_768p.safetensors")), flow_shift=12.0), ModelDefaults())
    two = tmp_path / "two"
    write_turbo_adapter(two, CFG, rank=2)
    write_turbo_adapter(two, CFG, rank=2, file_name="minimax_h3_fl2v_turbo_8step_v1.0.safetensors")
    with pytest.raises(AdapterError, match="holds exactly one matching file, found"):
        LoraCatalog(SHAPES, {"two": str(two)}, log=lines.append)
    wrong = _write(tmp_path, lora_tensors(CFG, 2, 0, suffix=".default"), c.file_name, {"key_format": "wan"})
    with pytest.raises(AdapterError, match="key_format 'wan'; expected minimax-h3-diffusers"):
        LoraCatalog(SHAPES, {"w": str(wrong.path)}, log=lines.append)


def test_a_queued_requests_adapter_survives_the_job_store(root):
    from h3serve.jobstore.codec import decode_request, encode_request
    from h3serve.rules.request import GenerationRequest

    catalog = LoraCatalog(SHAPES, {"turbo": str(root / "turbo")}, log=lambda s: None)
    request = GenerationRequest(prompt="x", lora=catalog.choose(LoraField(name="turbo", scale=0.25)))
    assert decode_request(encode_request(request)) == request
