"""h3serve.loading.tensors: every loaded CPU tensor sits on aligned, contiguous storage, so a result does not depend
on the tensor's byte offset in its safetensors file (MKL's CPU GEMM rounds differently on a weight that is not
16-byte aligned: the native and modular layouts of one checkpoint differed by 2e-5 in the audio before this)."""

from __future__ import annotations

import torch
from safetensors.torch import save_file
from torch import nn

from h3serve.loading.tensors import CPU_ALIGNMENT, aligned, iter_tensors, materialize, realign


def _offset_view(tensor: torch.Tensor, offset: int) -> torch.Tensor:
    """`tensor`'s values in a view `offset` floats into a fresh buffer (4·offset bytes past an aligned start)."""
    base = torch.zeros(tensor.numel() + offset)
    view = base[offset:].view(tensor.shape)
    view.copy_(tensor)
    return view


def test_aligned_copies_only_what_needs_it():
    weight = torch.randn(48, 32, generator=torch.Generator().manual_seed(0))
    assert aligned(weight) is weight  # a fresh allocation is aligned already
    shifted = _offset_view(weight, 1)
    fresh = aligned(shifted)
    assert fresh.data_ptr() % CPU_ALIGNMENT == 0 and torch.equal(fresh, weight)
    transposed = aligned(weight.t())
    assert transposed.is_contiguous() and torch.equal(transposed, weight.t())


def test_a_linear_gives_the_same_bits_at_every_file_offset(tmp_path):
    g = torch.Generator().manual_seed(1)
    weight, x = torch.randn(48, 32, generator=g), torch.randn(1, 32, generator=g)
    outputs = []
    for pad in range(4):  # a leading tensor of `pad` floats shifts the weight by 4·pad bytes in the file
        path = tmp_path / f"pad{pad}.safetensors"
        save_file({"a": torch.zeros(pad + 1), "weight": weight}, str(path))
        with torch.device("meta"):
            layer = nn.Linear(32, 48, bias=False)
        materialize(layer, iter_tensors([path], lambda k: k == "weight"), torch.float32, torch.device("cpu"))
        assert layer.weight.data_ptr() % CPU_ALIGNMENT == 0
        outputs.append(layer(x))
    assert all(torch.equal(out, outputs[0]) for out in outputs[1:])


def test_realign_gives_a_loaded_modules_tensors_their_own_storage():
    layer = nn.Linear(32, 48)
    reference = layer.weight.detach().clone()
    layer.weight.data = _offset_view(reference, 3)
    layer.register_buffer("table", _offset_view(torch.arange(8.0), 1))
    parameter = layer.weight
    assert realign(layer) is layer and layer.weight is parameter  # the same Parameter object, new storage
    assert layer.weight.data_ptr() % CPU_ALIGNMENT == 0 and torch.equal(layer.weight, reference)
    assert layer.table.data_ptr() % CPU_ALIGNMENT == 0 and torch.equal(layer.table, torch.arange(8.0))
