"""Defect 1 of issue 29: with tensor parallelism, online FP8 and a component kept in host memory, the quantiser
handed a CPU tensor to its MAX all-reduce on an NCCL group (a crash at load, on a GPU only). Every collective's
tensors must be on a device its group's backend serves; CUDA tensors are fakes here (FakeTensorMode)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from collective_devices import CollectiveDevices, FakeGroup
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from h3serve.accel.fp8 import Fp8Linear
from h3serve.accel.quantize import Fp8Load, backend_device_types, collective_device, quantize_in_place, quantizing
from h3serve.config.quantization_config import ComponentQuant

GPU = 1  # this rank's current device: not GPU 0, so a reduction on the wrong GPU would show too

# (group backend, device the weights are quantised on, where the reduction must run)
CASES = [
    ("nccl", "cpu", f"cuda:{GPU}"),  # the documented 2 x RTX 4090 FP8 + offload profile: the crash
    ("nccl", f"cuda:{GPU}", f"cuda:{GPU}"),
    ("gloo", f"cuda:{GPU}", "cpu"),
    ("gloo", "cpu", "cpu"),
    ("cpu:gloo,cuda:nccl", "cpu", "cpu"),
]


@dataclass
class RowSplit:
    """A tensor-parallel plan that splits every module by input features (its maxima span the ranks)."""

    group: FakeGroup

    def style(self, module_name: str) -> str | None:
        return "row"


def test_backends_and_the_devices_they_serve(monkeypatch):
    CollectiveDevices().install(monkeypatch, current_gpu=GPU)
    assert backend_device_types("nccl") == ("cuda",) and backend_device_types("gloo") == ("cpu",)
    assert backend_device_types("cpu:gloo,cuda:nccl") == ("cpu", "cuda")
    for backend, weights, expected in CASES:
        assert collective_device(FakeGroup(backend), torch.device(weights)) == torch.device(expected)


@pytest.mark.parametrize(("backend", "weights", "expected"), CASES)
def test_the_weight_stream_reduces_its_maxima_where_the_group_can(monkeypatch, backend, weights, expected):
    checker = CollectiveDevices(backend).install(monkeypatch, current_gpu=GPU)
    load = Fp8Load({"proj": Fp8Linear(32, 16, False, per_channel=False)})
    stream = [("proj.weight", torch.randn(16, 32)), ("other.bias", torch.randn(16))]
    with FakeTensorMode(allow_non_fake_inputs=True):
        out = dict(quantizing(iter(stream), load, torch.device(weights), RowSplit(FakeGroup(backend))))
    assert checker.calls == [("all_reduce", backend, (torch.device(expected).type,))]
    assert out["proj.weight"].device == torch.device(weights)
    assert out["proj.weight_scale"].device == torch.device(weights)  # the reduced maxima came back


@pytest.mark.parametrize(("backend", "weights", "expected"), CASES)
def test_in_place_quantisation_reduces_its_maxima_where_the_group_can(monkeypatch, backend, weights, expected):
    checker = CollectiveDevices(backend).install(monkeypatch, current_gpu=GPU)
    model = nn.Module()
    model.set_submodule("language_model", nn.Module())
    model.language_model.layers = nn.ModuleList([nn.Module()])
    model.language_model.layers[0].mlp = nn.Module()
    model.language_model.layers[0].mlp.down_proj = nn.Linear(32, 16, bias=True)
    quant = ComponentQuant("per_tensor")
    with FakeTensorMode(allow_non_fake_inputs=True):
        names = quantize_in_place(
            model, "text_encoder", quant, torch.bfloat16, "weight_only", torch.device(weights),
            RowSplit(FakeGroup(backend)),
        )
    assert names == ["language_model.layers.0.mlp.down_proj"]
    assert checker.calls == [("all_reduce", backend, (torch.device(expected).type,))]
    layer = model.get_submodule(names[0])
    assert isinstance(layer, Fp8Linear) and layer.weight_scale.device == torch.device(weights)
