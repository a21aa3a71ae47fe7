"""Attention backend registry: which kernel runs each attention role of the DiT.

Every backend computes the same dense, exact, bidirectional attention (no mask, no dropout) on q, k, v of shape
[B, S, H, Dh]; they differ only in the kernel. Roles are vLLM-Omni's: `self` (the main DiT blocks) and
`minimax_h3.token_refiner`. A backend that is unknown or not usable on this device and build is refused at
start-up with the list of usable ones; nothing falls back silently.

Sequence parallelism uses the `self` backend too: Ulysses calls its kernel on the gathered segment, and ring
attention its partial form (`with_lse`: attention over one block of keys that also returns the log-sum-exp, so
that partial results merge exactly). A backend without a partial form is refused with `--ring`.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from h3serve.accel.video_sparse import SparseSettings, VideoSparseAttention
from h3serve.errors import ServerError
from h3serve.model.transformer import AttentionFn, sdpa_attention

ROLES = ("self", "minimax_h3.token_refiner")
DEFAULT = "TORCH_SDPA"
# Sparse cores: they read the packed layout (h3serve.accel.video_sparse), so they serve the `self` role only. VSA
# runs its plain-torch reference off CUDA and FlexAttention block masks on CUDA.
SPARSE = ("FASTVIDEO_VSA",)


class AttentionBackendError(ServerError, ValueError):
    """An unknown or unusable backend; the message lists the usable ones."""

    code = "invalid_config"


def _cudnn_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):  # only this kernel: an unsupported shape raises, never falls back
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    return out.transpose(1, 2)


def _flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    from flash_attn import flash_attn_func

    return flash_attn_func(q, k, v, causal=False)  # takes and returns [B, S, H, Dh]


def _flashinfer_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    from flashinfer import single_prefill_with_kv_cache

    # One unpadded document per batch item: [S, H, Dh] in and out (NHD layout).
    items = zip(q, k, v, strict=True)
    return torch.stack([single_prefill_with_kv_cache(qi, ki, vi, causal=False) for qi, ki, vi in items])


# -- partial attention with log-sum-exp, for ring attention: q, k, v [B, H, S, Dh] -> ([B, H, Sq, Dh], [B, H, Sq])


def _math_attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scores = (q.float() @ k.float().transpose(-1, -2)) * q.shape[-1] ** -0.5
    lse = torch.logsumexp(scores, dim=-1)
    return (torch.exp(scores - lse[..., None]) @ v.float()).to(q.dtype), lse


def _sdpa_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch's fused kernels that return the LSE: CPU flash, CUDA flash (half precision) or memory-efficient
    attention; other devices use the explicit formula."""
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v)
        return out, lse.float()
    if q.device.type == "cuda":
        sq = q.shape[-2]
        if q.dtype in (torch.float16, torch.bfloat16):
            try:
                out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v)[:2]
                return out, lse[..., :sq].float()
            except RuntimeError:  # head_dim or architecture not supported by flash: the next kernel
                pass
        out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True)[:2]
        return out, lse[..., :sq].float()  # the efficient kernel pads the LSE's sequence dim
    return _math_attention_with_lse(q, k, v)


def cudnn_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """q, k, v made contiguous and checked as SDPA checks them before it picks cuDNN.

    The direct cuDNN op skips those checks, and ring attention hands it strided key/value slices of any length
    (a prefix of the block it received): an unsuitable input is refused here with the reason, never run."""
    q, k, v = (t.contiguous() for t in (q, k, v))
    params = torch.backends.cuda.SDPAParams(q, k, v, None, 0.0, False, False)
    if not torch.backends.cuda.can_use_cudnn_attention(params, debug=True):  # debug: warns with the reason
        raise RuntimeError(
            f"CUDNN_ATTN cannot run q {tuple(q.shape)} {q.dtype} on {q.device} against {k.shape[-2]} keys (the "
            "warning above says why); choose --diffusion-attention-backend TORCH_SDPA"
        )
    return q, k, v


def _cudnn_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    q, k, v = cudnn_inputs(q, k, v)
    out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True)[:2]
    return out, lse.reshape(q.shape[:-1]).float()


def _flash_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    from flash_attn import flash_attn_func

    out, lse, _ = flash_attn_func(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=False, return_attn_probs=True
    )
    return out.transpose(1, 2), lse.float()  # flash-attn's LSE is [B, H, Sq], natural log


def _has(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


PartialFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class Backend:
    fn: AttentionFn
    unusable: Callable[[torch.device], str | None]  # why it cannot run on this device and build; None: usable
    with_lse: PartialFn | None = None  # the partial form ring attention merges; None: no ring attention
    half_only: bool = False  # its kernels take float16 / bfloat16 only (refused at start-up with --dtype float32)


def _cuda_only(extra: Callable[[], str | None] = lambda: None) -> Callable[[torch.device], str | None]:
    def check(device: torch.device) -> str | None:
        if device.type != "cuda":
            return "needs a CUDA device"
        return extra()

    return check


BACKENDS: dict[str, Backend] = {
    "TORCH_SDPA": Backend(sdpa_attention, lambda device: None, _sdpa_with_lse),
    "FLASH_ATTN": Backend(
        _flash_attention,
        _cuda_only(lambda: None if _has("flash_attn") else "flash-attn is not installed"),
        _flash_with_lse,
        half_only=True,
    ),
    "CUDNN_ATTN": Backend(
        _cudnn_attention,
        _cuda_only(lambda: None if torch.backends.cudnn.is_available() else "this torch build has no cuDNN"),
        _cudnn_with_lse,
        half_only=True,
    ),
    "FLASHINFER_ATTN": Backend(
        _flashinfer_attention,
        _cuda_only(lambda: None if _has("flashinfer") else "flashinfer is not installed"),
        half_only=True,
    ),
}
# vLLM-Omni names h3serve knows but has no kernel for: refused with this reason.
NOT_PROVIDED = {
    "TRTLLM_ATTN": "FlashInfer's trtllm-gen kernels (datacenter Blackwell) are not wired into h3serve",
    "FLASH_ATTN_HUB": "kernels from the Hugging Face hub are not loaded by h3serve",
    "FLASH_ATTN_3_HUB": "kernels from the Hugging Face hub are not loaded by h3serve",
}


HALF_DTYPES = (torch.float16, torch.bfloat16)


def usable_backends(device: torch.device, dtype: torch.dtype | None = None) -> list[str]:
    """The backends that can run on `device` (and, given the compute dtype, in it)."""
    wrong_dtype = dtype is not None and dtype not in HALF_DTYPES
    return [n for n, b in BACKENDS.items() if b.unusable(device) is None and not (b.half_only and wrong_dtype)]


def check_backend(
    name: str,
    device: torch.device,
    where: str = "--diffusion-attention-backend",
    ring: bool = False,
    dtype: torch.dtype | None = None,  # the compute dtype; None: not checked
) -> None:
    """Raise `AttentionBackendError` unless `name` can run on `device` in `dtype` (and, with `ring`, run ring
    attention)."""
    usable = ", ".join(usable_backends(device, dtype))
    if name in SPARSE:
        if where != "--diffusion-attention-backend" and not where.endswith("per_role.self"):
            raise AttentionBackendError(f"{where} {name}: video sparse attention tiles the target video's rows; it "
                                        "serves the DiT blocks (role self) only")
        if ring:
            raise AttentionBackendError(f"{where} {name}: video sparse attention runs on whole rows; not with --ring")
        return
    backend = BACKENDS.get(name)
    if backend is not None and backend.half_only and device.type == "cuda" and dtype not in (None, *HALF_DTYPES):
        raise AttentionBackendError(
            f"{where} {name}: its kernels take float16 or bfloat16, the compute dtype is {str(dtype).split('.')[-1]}; "
            f"use --dtype bfloat16, or choose from: {usable}"
        )
    if ring and name in BACKENDS and BACKENDS[name].with_lse is None:
        ring_ready = ", ".join(n for n, b in BACKENDS.items() if b.with_lse is not None)
        raise AttentionBackendError(
            f"{where} {name}: its kernel returns no log-sum-exp here, which ring attention (--ring) needs to merge "
            f"its partial results; choose from: {ring_ready}"
        )
    if name in BACKENDS:
        reason = BACKENDS[name].unusable(device)
    else:
        reason = NOT_PROVIDED.get(name, "unknown backend")
    if reason is not None:
        raise AttentionBackendError(f"{where} {name}: {reason}; available on {device.type}: {usable}")


def resolve_roles(
    default: str,
    per_role: tuple[tuple[str, str], ...],
    device: torch.device,
    ring: bool = False,
    dtype: torch.dtype | None = None,
) -> dict[str, str]:
    """The backend of every role (`auto` is TORCH_SDPA), each checked against `device`; with `ring`, the `self`
    role's backend must also have the partial form ring attention merges."""
    unknown = sorted({role for role, _ in per_role} - set(ROLES))
    if unknown:
        raise AttentionBackendError(
            f"--diffusion-attention-config per_role: unknown roles {', '.join(unknown)}; "
            f"choose from: {', '.join(ROLES)}"
        )
    base = DEFAULT if default == "auto" else default
    overridden = dict(per_role)
    check_backend(base, device, ring=ring and "self" not in overridden, dtype=dtype)
    chosen = dict.fromkeys(ROLES, base)
    if base in SPARSE:  # a sparse default names the DiT blocks' core; the text-only refiner stays dense
        chosen["minimax_h3.token_refiner"] = DEFAULT
    for role, name in per_role:
        check_backend(
            name, device, f"--diffusion-attention-config per_role.{role}", ring=ring and role == "self", dtype=dtype
        )
        chosen[role] = name
    return chosen


def install(transformer: nn.Module, roles: dict[str, str], sparse: SparseSettings | None = None) -> None:
    """Set the attention core of every block of `transformer` (an H3Transformer) from its role's backend;
    `sparse`: VSA's top-k setting when the `self` role's backend is sparse (default: sparsity 0.8).

    Runs before sequence parallelism is installed: SP replaces the main blocks' core with its own exchange.
    """
    gated = any(block.attn.to_gate_compress is not None for block in transformer.transformer_blocks)
    if roles["self"] in SPARSE:
        device = next(transformer.parameters()).device
        core = VideoSparseAttention(sparse or SparseSettings(), "flex" if device.type == "cuda" else "reference")
        transformer.sparse_attention = core
        for block in transformer.transformer_blocks:
            block.attn.attention_fn = core
    elif gated:
        raise AttentionBackendError(
            f"--diffusion-attention-backend {roles['self']}: this DiT's blocks carry video sparse attention gates "
            f"(attn.to_gate_compress), trained with VSA; use --diffusion-attention-backend {SPARSE[0]}"
        )
    else:
        transformer.sparse_attention = None
        for block in transformer.transformer_blocks:
            block.attn.attention_fn = BACKENDS[roles["self"]].fn
    for block in transformer.token_refiner.refiner_blocks:
        block.attn.attention_fn = BACKENDS[roles["minimax_h3.token_refiner"]].fn
