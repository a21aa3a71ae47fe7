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
