"""Attention backend registry: per-role selection, refusals that list the usable backends, installation."""

from __future__ import annotations

import pytest
import torch
from small_dit import SMALL_DIT

from h3serve.accel import attention
from h3serve.accel.attention import AttentionBackendError, resolve_roles, usable_backends
from h3serve.model.transformer import H3Transformer, H3TransformerConfig

CPU = torch.device("cpu")


def test_auto_is_torch_sdpa_for_every_role_and_overrides_apply_per_role(monkeypatch):
    assert resolve_roles("auto", (), CPU) == {"self": "TORCH_SDPA", "minimax_h3.token_refiner": "TORCH_SDPA"}
    # Pretend a CUDA build with cuDNN to select a different kernel for the refiner only.
    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: True)
    cuda = torch.device("cuda")
    roles = resolve_roles("TORCH_SDPA", (("minimax_h3.token_refiner", "CUDNN_ATTN"),), cuda)
    assert roles == {"self": "TORCH_SDPA", "minimax_h3.token_refiner": "CUDNN_ATTN"}
    assert "CUDNN_ATTN" in usable_backends(cuda) and usable_backends(CPU) == ["TORCH_SDPA"]


@pytest.mark.parametrize(
    "default, per_role, message",
    [
        ("FLASH_ATTN", (), "FLASH_ATTN: needs a CUDA device; available on cpu: TORCH_SDPA"),
        ("SOMETHING", (), "SOMETHING: unknown backend; available on cpu: TORCH_SDPA"),
        ("auto", (("self", "FLASHINFER_ATTN"),), "per_role.self FLASHINFER_ATTN: needs a CUDA device"),
        ("auto", (("cross", "TORCH_SDPA"),), "unknown roles cross"),
    ],
)
def test_unusable_or_unknown_backends_are_refused_with_the_usable_list(default, per_role, message):
    with pytest.raises(AttentionBackendError, match=message):
        resolve_roles(default, per_role, CPU)


def test_a_cuda_build_without_the_library_names_what_is_missing(monkeypatch):
    monkeypatch.setattr(attention, "_has", lambda module: False)
    with pytest.raises(AttentionBackendError, match="flash-attn is not installed"):
        resolve_roles("FLASH_ATTN", (), torch.device("cuda"))


def test_install_sets_each_role_on_its_blocks():
    cfg = H3TransformerConfig(**SMALL_DIT)
    with torch.device("meta"):
        model = H3Transformer(cfg)
    attention.install(model, {"self": "TORCH_SDPA", "minimax_h3.token_refiner": "CUDNN_ATTN"})
    assert all(b.attn.attention_fn is attention.BACKENDS["TORCH_SDPA"].fn for b in model.transformer_blocks)
    refiner = model.token_refiner.refiner_blocks
    assert all(b.attn.attention_fn is attention.BACKENDS["CUDNN_ATTN"].fn for b in refiner)


def test_ring_needs_a_backend_with_a_log_sum_exp_kernel(monkeypatch):
    monkeypatch.setattr(attention, "_has", lambda module: True)  # a CUDA build with every library
    cuda = torch.device("cuda")
    with pytest.raises(AttentionBackendError, match="FLASHINFER_ATTN: its kernel returns no log-sum-exp .* "
                                                    "choose from: TORCH_SDPA, FLASH_ATTN, CUDNN_ATTN"):
        resolve_roles("FLASHINFER_ATTN", (), cuda, ring=True)
    with pytest.raises(AttentionBackendError, match="per_role.self FLASHINFER_ATTN: its kernel returns no log-sum"):
        resolve_roles("auto", (("self", "FLASHINFER_ATTN"),), cuda, ring=True)
    # Only the main blocks run ring attention: the refiner may use any kernel, and without --ring so may `self`.
    roles = resolve_roles("FLASH_ATTN", (("minimax_h3.token_refiner", "FLASHINFER_ATTN"),), cuda, ring=True)
    assert roles["self"] == "FLASH_ATTN" and resolve_roles("FLASHINFER_ATTN", (), cuda)["self"] == "FLASHINFER_ATTN"


def test_partial_kernels_return_the_attention_and_its_log_sum_exp():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 3, 9, 16, generator=g) for _ in range(3))  # [B, H, S, Dh]
    expected_out, expected_lse = attention._math_attention_with_lse(q, k, v)
    for name in usable_backends(CPU):
        out, lse = attention.BACKENDS[name].with_lse(q, k, v)
        assert lse.dtype == torch.float32 and lse.shape == (2, 3, 9)
        assert (out - expected_out).abs().max() < 1e-5 and (lse - expected_lse).abs().max() < 1e-5
        whole = attention.BACKENDS[name].fn(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        assert (whole.transpose(1, 2) - out).abs().max() < 1e-5  # the two forms of one backend agree


@pytest.mark.parametrize("name", ["FLASH_ATTN", "CUDNN_ATTN", "FLASHINFER_ATTN"])
def test_half_precision_kernels_are_refused_with_a_float32_compute_dtype(monkeypatch, name):
    monkeypatch.setattr(attention, "_has", lambda module: True)  # a CUDA build with every library
    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: True)
    cuda = torch.device("cuda")
    with pytest.raises(AttentionBackendError, match=f"{name}: its kernels take float16 or bfloat16, the compute "
                                                    "dtype is float32; use --dtype bfloat16, or choose from: "
                                                    "TORCH_SDPA$"):
        resolve_roles(name, (), cuda, dtype=torch.float32)
    with pytest.raises(AttentionBackendError, match=f"per_role.minimax_h3.token_refiner {name}: its kernels take"):
        resolve_roles("auto", (("minimax_h3.token_refiner", name),), cuda, dtype=torch.float32)
    assert resolve_roles(name, (), cuda, dtype=torch.bfloat16)["self"] == name
    assert usable_backends(cuda, torch.float32) == ["TORCH_SDPA"] and name in usable_backends(cuda, torch.float16)


def test_cudnn_gets_contiguous_inputs_it_was_checked_for(monkeypatch):
    """Ring attention hands the cuDNN op strided key/value prefixes: they are made contiguous and put through
    SDPA's own suitability check, which refuses what cuDNN cannot run instead of running it."""
    kv = torch.randn(2, 1, 2, 16, 8)
    q, k, v = torch.randn(1, 2, 16, 8), kv[0, :, :, :11], kv[1, :, :, :11]
    assert not k.is_contiguous()
    checked = []

    def can_use(params, debug=False):
        checked.append((params.query.is_contiguous(), params.key.is_contiguous(), params.value.is_contiguous()))
        return True

    monkeypatch.setattr(torch.backends.cuda, "can_use_cudnn_attention", can_use)
    out = attention.cudnn_inputs(q, k, v)
    assert checked == [(True, True, True)] and all(t.is_contiguous() for t in out)
    assert torch.equal(out[1], k) and torch.equal(out[2], v)
    monkeypatch.setattr(torch.backends.cuda, "can_use_cudnn_attention", lambda params, debug=False: False)
    with pytest.raises(RuntimeError, match=r"CUDNN_ATTN cannot run q \(1, 2, 16, 8\) .* against 11 keys .* "
                                           "TORCH_SDPA"):
        attention.cudnn_inputs(q, k, v)
