"""MiniMax-H3 joint video + audio DiT.

State-dict compatible with diffusers' `MiniMaxH3Transformer3DModel` (same keys, shapes and math; see
docs/model.md §2). One forward denoises one packed sequence: text rows, conditioning rows, target audio
rows and target video rows, all attending to each other bidirectionally. Each row carries its own timestep
(one row of a small table of distinct timesteps) and its own modality tag, which together pick its AdaLN
modulation.

Reading order: config -> rotary embedding -> small modules (attention, feed-forward, modulation) ->
refiner -> block -> model.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from h3serve.model.transformer_config import H3TransformerConfig

NUM_MODALITIES = 3  # video 0, text 1, audio 2: the AdaLN table has one slot per (timestep, modality)

AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class SparseAttention(Protocol):
    """An attention core that needs the packed layout (video sparse attention, h3serve.accel.video_sparse): the DiT
    calls `prepare` once per forward, then every block calls it with q, k, v [B, S, H, Dh] and its gate."""

    def prepare(self, layout: PackedLayout) -> None: ...

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gate: torch.Tensor | None = None
    ) -> torch.Tensor: ...


class BlockLoop(Protocol):
    """A step cache around the block loop (h3serve.accel.teacache): given the DiT and the loop's inputs, it runs
    the loop (`H3Transformer.run_blocks`) or reuses the residual of the last step that did."""

    def __call__(
        self,
        dit: H3Transformer,
        x: torch.Tensor,
        temb: torch.Tensor | StepModulation,
        adaln_idx: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor: ...


class SequenceSharder(Protocol):
    """Sequence parallelism around the block loop (implemented in h3serve.parallel.sequence)."""

    def shard(
        self, x: torch.Tensor, adaln_idx: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor]]: ...

    def gather(self, x: torch.Tensor) -> torch.Tensor: ...


# ---------------------------------------------------------------------------------------------------------------
# Rotary embedding (3 axes, NeoX rotate-half on the leading 6·Fr channels of each head)
# ---------------------------------------------------------------------------------------------------------------


class RotaryEmbedding3D(nn.Module):
    """(t, h, w) positions -> cos/sin tables of shape [S, 6·Fr]. The three axes share one frequency table."""

    def __init__(self, rope_freq_dim: int, theta: float):
        super().__init__()
        exponents = torch.arange(0, 2 * rope_freq_dim, 2, dtype=torch.float32) / (2 * rope_freq_dim)
        self.register_buffer("inv_freq", 1.0 / theta**exponents, persistent=False)

    def forward(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        angles = position_ids.to(torch.float32)[:, :, None] * self.inv_freq  # [S, 3, Fr]
        angles = angles.flatten(1)  # [S, 3·Fr]: t block, h block, w block
        angles = torch.cat((angles, angles), dim=-1)  # [S, 6·Fr]
        return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on the leading cos.shape[-1] channels of x [B, S, H, Dh]; the rest pass through.

    The tables' two halves are equal (see RotaryEmbedding3D), so each output half is written straight into one
    preallocated tensor from half-size products: no negated copy and no concatenation. Bit-identical to
    `x·cos + cat(-x2, x1)·sin` (negation is exact and a + (-b) == a - b in IEEE arithmetic).
    """
    rot_dim = cos.shape[-1]
    half = rot_dim // 2
    c = cos[:, :half].to(x.dtype)[None, :, None, :]
    s = sin[:, :half].to(x.dtype)[None, :, None, :]
    x1, x2 = x[..., :half], x[..., half:rot_dim]
    # Inductor fuses this form into one kernel (`out=` views would graph-break), and autograd (the demo trainer)
    # cannot differentiate `out=`: the same products and sums, so the same values.
    if torch.compiler.is_compiling() or (x.requires_grad and torch.is_grad_enabled()):
        return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s, x[..., rot_dim:]), dim=-1)
    out = torch.empty_like(x)
    torch.sub(x1 * c, x2 * s, out=out[..., :half])
    torch.add(x2 * c, x1 * s, out=out[..., half:rot_dim])
    out[..., rot_dim:] = x[..., rot_dim:]
    return out


def compute_dtype(linear: nn.Module) -> torch.dtype:
    """The dtype a linear layer computes in: its weight's, or the declared `compute_dtype` of a quantised linear
    (h3serve.accel.fp8), whose weight is stored in one byte."""
    return getattr(linear, "compute_dtype", linear.weight.dtype)


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Full bidirectional attention. q, k, v: [B, S, H, Dh] -> [B, S, H, Dh]."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    return out.transpose(1, 2)


# ---------------------------------------------------------------------------------------------------------------
# Small modules
# ---------------------------------------------------------------------------------------------------------------


class Attention(nn.Module):
    """Multi-head attention with per-head QK RMSNorm and optional RoPE. No biases.

    `attention_fn` is the pluggable core (SDPA by default); sequence-parallel strategies replace it.
    Checkpoints carry `to_q`, `to_k`, `to_v`; `fuse_qkv()` turns them into one projection after loading.
    """

    def __init__(self, hidden_size: int, heads: int, head_dim: int, qk_norm_eps: float):
        super().__init__()
        self.heads = heads
        self.head_dim = head_dim
        inner = heads * head_dim
        self.to_q = nn.Linear(hidden_size, inner, bias=False)
        self.to_k = nn.Linear(hidden_size, inner, bias=False)
        self.to_v = nn.Linear(hidden_size, inner, bias=False)
        self.norm_q = nn.RMSNorm(head_dim, eps=qk_norm_eps)
        self.norm_k = nn.RMSNorm(head_dim, eps=qk_norm_eps)
        self.to_out = nn.ModuleList([nn.Linear(inner, hidden_size, bias=False), nn.Identity()])
        self.to_qkv: nn.Linear | None = None  # set by fuse_qkv()
        # Video sparse attention's learned gate on its coarse branch (FastH3 V2 checkpoints; `add_sparse_gate`):
        # x [B, S, D] -> [B, S, H·Dh]. None: no gate (the core is called with q, k, v only).
        self.to_gate_compress: nn.Linear | None = None
        self.attention_fn: AttentionFn = sdpa_attention

    def add_sparse_gate(self, bias: bool) -> None:
        """Give the attention VSA's gate projection (uninitialised; the loader fills it)."""
        hidden = (self.to_q if self.to_qkv is None else self.to_qkv).weight.shape[1]
        self.to_gate_compress = nn.Linear(hidden, self.heads * self.head_dim, bias=bias)

    def gate(self, x: torch.Tensor) -> torch.Tensor | None:
        """x [B, S, D] -> the sparse core's gate [B, S, H, Dh] (per row, like q); None without a gate."""
        if self.to_gate_compress is None:
            return None
        return self.to_gate_compress(x).unflatten(-1, (-1, self.head_dim))

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gate: torch.Tensor | None
    ) -> torch.Tensor:
        """The attention core on q, k, v (and the sparse core's gate, when the attention has one)."""
        if gate is None:
            return self.attention_fn(q, k, v)
        return self.attention_fn(q, k, v, gate)

    @torch.no_grad()
    def fuse_qkv(self) -> None:
        """Replace `to_q`, `to_k`, `to_v` by one projection `to_qkv` whose output is [q | k | v].

        Exact: every output column is the same dot product as before, only computed in one GEMM (one read of x,
        one kernel launch). Runs on loaded weights, after tensor-parallel sharding (it fuses this rank's shards).
        """
        parts = (self.to_q, self.to_k, self.to_v)
        if not isinstance(parts[0], nn.Linear):  # a quantised linear (h3serve.accel.fp8) stacks its own kind
            fused_layer = type(parts[0]).concat(list(parts))
            del self.to_q, self.to_k, self.to_v
            self.to_qkv = fused_layer
            return
        weight = torch.cat([m.weight for m in parts])  # [3·inner, D]
        fused = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
        fused.weight = nn.Parameter(weight, requires_grad=False)
        del self.to_q, self.to_k, self.to_v
        self.to_qkv = fused

    def project_qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, S, D] -> q, k, v [B, S, H, Dh], before normalisation. Head count comes from the weights, so a
        tensor-parallel shard works unchanged."""
        if self.to_qkv is not None:
            q, k, v = self.to_qkv(x).unflatten(-1, (3, -1, self.head_dim)).unbind(-3)
            return q, k, v
        return tuple(m(x).unflatten(-1, (-1, self.head_dim)) for m in (self.to_q, self.to_k, self.to_v))

    def qkv(
        self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, S, D] -> q, k, v [B, S, H, Dh]: projected, q and k normalised and rotated. Per row."""
        q, k, v = self.project_qkv(x)
        q, k = self.norm_q(q), self.norm_k(k)
        if rotary is not None:
            q, k = apply_rotary(q, *rotary), apply_rotary(k, *rotary)
        return q, k, v

    def project_out(self, attended: torch.Tensor) -> torch.Tensor:
        """The attention core's output [B, S, H, Dh] -> [B, S, D]. Per row."""
        return self.to_out[0](attended.flatten(2))

    def forward(self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        q, k, v = self.qkv(x, rotary)  # [B, S, H, Dh] each
        return self.project_out(self.attend(q, k, v, self.gate(x)).type_as(q))


class SwiGLUProjection(nn.Module):
    """One fused projection whose output halves are [value; gate] (diffusers' order)."""

    def __init__(self, dim: int, inner_dim: int):
        super().__init__()
        self.proj = nn.Linear(dim, 2 * inner_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        value, gate = self.proj(x).chunk(2, dim=-1)
        # silu's fresh result takes the product in place (same values as value·silu(gate), one temporary less).
        return F.silu(gate).mul_(value)


class FeedForward(nn.Module):
    """SwiGLU FFN, keys `net.0.proj` and `net.2` (slot 1 is the parameter-free dropout slot)."""

    def __init__(self, dim: int, inner_dim: int):
        super().__init__()
        self.net = nn.ModuleList(
            [SwiGLUProjection(dim, inner_dim), nn.Identity(), nn.Linear(inner_dim, dim, bias=False)]
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net[2](self.net[0](x))


class TimestepEmbedder(nn.Module):
    """t in [0, 1] (unscaled) -> cos-first sinusoid -> MLP. Runs in the dtype of its weights (fp32 policy)."""

    def __init__(self, freq_dim: int, hidden_dim: int, out_dim: int):
        super().__init__()
        self.freq_dim = freq_dim
        self.linear_1 = nn.Linear(freq_dim, hidden_dim, bias=True)
        self.linear_2 = nn.Linear(hidden_dim, out_dim, bias=True)

    def sinusoid(self, t: torch.Tensor) -> torch.Tensor:
        half = self.freq_dim // 2
        exponent = -math.log(10000.0) * torch.arange(half, dtype=torch.float32, device=t.device) / half
        angles = t.float()[:, None] * torch.exp(exponent)[None, :]
        return torch.cat((angles.cos(), angles.sin()), dim=-1)  # [T, freq_dim], cos half first

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        e = self.sinusoid(t).to(self.linear_1.weight.dtype)
        return self.linear_2(F.silu(self.linear_1(e)))


class AdaLNModulation(nn.Module):
    """temb [T, E] -> six [T·3, D] tables (shift/scale/gate for attention, then for the FFN): see `table`.

    Row `t·3 + modality` of each table belongs to that (timestep, modality) pair: the linear's output is
    modality-major, feature `modality·6D + p·D + c`.
    """

    def __init__(self, time_embed_dim: int, hidden_size: int):
        super().__init__()
        self.hidden_size = hidden_size
        self.linear = nn.Linear(time_embed_dim, 6 * hidden_size * NUM_MODALITIES, bias=True)

    def table(self, temb: torch.Tensor) -> torch.Tensor:
        """[6, T·3, D]: shift, 1 + scale, gate (attention), then the same for the FFN, each a contiguous table.

        `1 + scale` is formed here on the small table rather than per row after the gather: the same values, one
        [S, D] temporary less per use. Six contiguous tables make six cheap row gathers; one gather of [T·3, 6D]
        rows measured ~10x slower on CPU (index_select copies long rows serially).
        """
        # SiLU at temb's precision (fp32); only its result is cast to the projection's dtype.
        m = self.linear(F.silu(temb).to(compute_dtype(self.linear))).view(-1, 6, self.hidden_size)
        one_plus = m.new_zeros((1, 6, 1))
        one_plus[:, 1] = 1.0
        one_plus[:, 4] = 1.0
        return (m + one_plus).transpose(0, 1).contiguous()


class AdaLNOut(nn.Module):
    """Final RMSNorm modulated per row by its timestep only (halves are shift, then scale)."""

    def __init__(self, hidden_size: int, time_embed_dim: int, eps: float):
        super().__init__()
        self.norm = nn.RMSNorm(hidden_size, eps=eps)
        self.linear = nn.Linear(time_embed_dim, 2 * hidden_size, bias=True)

    def modulation(self, temb: torch.Tensor) -> torch.Tensor:
        """temb [T, E] -> [T, 2D]: shift, then scale (what `h3serve.model.adaln_memo` computes ahead)."""
        return self.linear(F.silu(temb).to(compute_dtype(self.linear)))

    def apply(self, x: torch.Tensor, modulation: torch.Tensor, timestep_indices: torch.Tensor) -> torch.Tensor:
        shift, scale = modulation.chunk(2, dim=-1)
        return self.norm(x) * (1.0 + scale.index_select(0, timestep_indices)) + shift.index_select(0, timestep_indices)

    def forward(self, x: torch.Tensor, temb: torch.Tensor, timestep_indices: torch.Tensor) -> torch.Tensor:
        return self.apply(x, self.modulation(temb), timestep_indices)


@dataclass(frozen=True)
class StepModulation:
    """One forward's AdaLN modulations, computed ahead of it (`h3serve.model.adaln_memo`): the same values the
    forward would compute from `temb`, so the blocks gather from these instead of running their projections.

    Only the table rows the step uses are kept (`slots` maps a full-table row `t·3 + modality` to its row here;
    -1 for a row no token reads): a row gather copies values, so the result is bit-identical.
    """

    tables: Mapping[nn.Module, torch.Tensor]  # a block's `adaln_proj` -> its [6, R, D] table (see `table`)
    slots: torch.Tensor  # [T·3] long
    output: torch.Tensor  # [T, 2D]: `norm_out.modulation(temb)`


class ControlRows(Protocol):
    """A request's control input (h3serve.model.controlnet.ControlInput): rows [B, Nv, 196] and the hint scale."""

    rows: torch.Tensor
    scale: float


@dataclass(frozen=True)
class StepHeads:
    """Output heads that change with the denoise step (a PDD adapter's fused head bank): forward k of a request
    projects with row k of each bank instead of `proj_out` / `audio_proj_out`. fp32, on the DiT's device."""

    video_weight: torch.Tensor  # [F, C·4, D]
    video_bias: torch.Tensor  # [F, C·4]
    audio_weight: torch.Tensor  # [F, 32, D]
    audio_bias: torch.Tensor  # [F, 32]


def row_spans(rows: int, chunk: int) -> list[slice]:
    """`rows` split into the fewest spans of at most `chunk` rows, of equal sizes (± 1): no short tail span, whose
    few-row GEMMs a BLAS may compute with another kernel (on CPU, fp32 GEMMs of under 8 rows round differently)."""
    count = -(-rows // chunk)
    base, extra = divmod(rows, count)
    spans, start = [], 0
    for i in range(count):
        size = base + (i < extra)
        spans.append(slice(start, start + size))
        start += size
    return spans


# ---------------------------------------------------------------------------------------------------------------
# Blocks
# ---------------------------------------------------------------------------------------------------------------


class TokenRefinerBlock(nn.Module):
    """Pre-norm attention + FFN over the text rows only: no AdaLN, no RoPE, no mask."""

    def __init__(self, cfg: H3TransformerConfig):
        super().__init__()
        self.norm1 = nn.RMSNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.attn = Attention(cfg.hidden_size, cfg.num_attention_heads, cfg.attention_head_dim, cfg.qk_norm_eps)
        self.norm2 = nn.RMSNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.ff = FeedForward(cfg.hidden_size, cfg.ffn_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.ff(self.norm2(x))


class TokenRefiner(nn.Module):
    def __init__(self, cfg: H3TransformerConfig):
        super().__init__()
        self.refiner_blocks = nn.ModuleList([TokenRefinerBlock(cfg) for _ in range(cfg.num_refiner_layers)])
        self.final_norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.final_norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.refiner_blocks:
            x = block(x)
        return self.final_norm(x)


class TransformerBlock(nn.Module):
    """AdaLN-modulated attention (with RoPE) and SwiGLU FFN, each gated; no tanh on the gates."""

    def __init__(self, cfg: H3TransformerConfig):
        super().__init__()
        self.norm1 = nn.RMSNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.attn = Attention(cfg.hidden_size, cfg.num_attention_heads, cfg.attention_head_dim, cfg.qk_norm_eps)
        self.norm2 = nn.RMSNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.ff = FeedForward(cfg.hidden_size, cfg.ffn_dim)
        self.adaln_proj = AdaLNModulation(cfg.time_embed_dim, cfg.hidden_size)

    # What regional compilation compiles (h3serve.accel.compile): the modulation lookup stays eager, so a block
    # graph never specialises on which block's table it reads, and the AdaLN GEMM runs the same kernel whether
    # the forward computes it or `h3serve.model.adaln_memo` did ahead.
    compiled_region = "modulated"
    # Set by the placement (h3serve.offload.runtime, the planner's `denoise_chunk_rows`): the block's working set
    # in chunks of this many rows (`modulated_in_chunks`); None runs every row at once.
    row_chunk: int | None = None

    def forward(
        self,
        x: torch.Tensor,  # [B, S, D]
        temb: torch.Tensor | StepModulation,  # [T, E], or this step's precomputed modulations
        adaln_idx: torch.Tensor,  # [S]: timestep_index·3 + modality (a row of `StepModulation.tables`)
        rotary: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        # [6, T·3, D] (or the step's used rows); the scale tables hold 1 + scale
        table = temb.tables[self.adaln_proj] if isinstance(temb, StepModulation) else self.adaln_proj.table(temb)
        return self.modulated(x, table, adaln_idx, rotary)

    def modulated_input(
        self, x: torch.Tensor, temb: torch.Tensor | StepModulation, adaln_idx: torch.Tensor
    ) -> torch.Tensor:
        """The attention branch's input: norm1(x)·(1 + scale) + shift, each row's modulation by its (timestep,
        modality) pair. [B, S, D]; what TeaCache watches (h3serve.accel.teacache) on the first block."""
        table = temb.tables[self.adaln_proj] if isinstance(temb, StepModulation) else self.adaln_proj.table(temb)
        return self.norm1(x).mul_(table[1].index_select(0, adaln_idx)).add_(table[0].index_select(0, adaln_idx))

    def modulated(
        self, x: torch.Tensor, table: torch.Tensor, adaln_idx: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor]
    ) -> torch.Tensor:
        if self.row_chunk is not None and x.shape[1] > self.row_chunk:
            return self.modulated_in_chunks(x, table, adaln_idx, rotary, self.row_chunk)
        # Row gathers from the six tables (index_select: a plain gather, cheaper than advanced indexing on CPU).
        shift1, scale1, gate1, shift2, scale2, gate2 = (t.index_select(0, adaln_idx) for t in table)  # [S, D] each
        # In place on fresh temporaries only: norm outputs and branch outputs, never x itself (hooks may hold it).
        h = self.attn(self.norm1(x).mul_(scale1).add_(shift1), rotary).mul_(gate1)
        x = x + h
        h = self.ff(self.norm2(x).mul_(scale2).add_(shift2)).mul_(gate2)
        return x + h

    def modulated_in_chunks(
        self,
        x: torch.Tensor,
        table: torch.Tensor,
        adaln_idx: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor],
        chunk: int,
    ) -> torch.Tensor:
        """`modulated` with its working set bounded by `chunk` rows: the gathered modulations, the normalised inputs,
        the projections and the FFN live for one chunk at a time; only q, k, v and the attention output (attention
        needs every row) and the residual stream in and out are whole. Every operation but attention is per row,
        so each row gets the same values as in one pass: on CPU bit for bit (tests/model/test_transformer.py); on a
        GPU the same kernels run on fewer rows, where cuBLAS may pick another tiling for the smaller M (the same
        math, possibly other roundings)."""
        batch, rows = x.shape[:2]
        spans = row_spans(rows, chunk)
        cos, sin = rotary
        q = k = v = gate = None
        for span in spans:
            idx = adaln_idx[span]
            h = self.norm1(x[:, span]).mul_(table[1].index_select(0, idx)).add_(table[0].index_select(0, idx))
            parts = self.attn.qkv(h, (cos[span], sin[span]))
            gate_part = self.attn.gate(h)
            if q is None:  # [B, S, H, Dh] each, filled chunk by chunk
                q, k, v = (part.new_empty((batch, rows, *part.shape[2:])) for part in parts)
                gate = None if gate_part is None else gate_part.new_empty((batch, rows, *gate_part.shape[2:]))
            for whole, part in zip((q, k, v), parts, strict=True):
                whole[:, span] = part
            if gate is not None:
                gate[:, span] = gate_part
        attended = self.attn.attend(q, k, v, gate).type_as(q)
        del q, k, v, gate
        out = torch.empty_like(x)
        for span in spans:
            idx = adaln_idx[span]
            mid = x[:, span] + self.attn.project_out(attended[:, span]).mul_(table[2].index_select(0, idx))
            h = self.norm2(mid).mul_(table[4].index_select(0, idx)).add_(table[3].index_select(0, idx))
            torch.add(mid, self.ff(h).mul_(table[5].index_select(0, idx)), out=out[:, span])
        return out


# ---------------------------------------------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PackedLayout:
    """Where every row of the packed sequence comes from, its modality and its position.

    Fixed for a whole request and shared by every item of a batch. Built by `h3serve.model.layout`.
    """

    token_tags: torch.Tensor  # [S] long: 0 video, 1 text, 2 audio
    position_ids: torch.Tensor  # [S, 3] float64: (t, h, w) RoPE coordinates
    video_indices: torch.Tensor  # [Nv] long: packed positions of video rows (conditions first)
    audio_indices: torch.Tensor  # [Na] long: packed positions of audio rows (references first)
    text_indices: torch.Tensor  # [L] long
    # (latent frames, rows, columns) of the target video, whose rows end the sequence frame-major; None: no video.
    # What video sparse attention tiles into cubes (h3serve.accel.video_sparse).
    target_grid: tuple[int, int, int] | None = None

    @property
    def seq_len(self) -> int:
        return self.position_ids.shape[0]

    def to(self, device: torch.device | str) -> PackedLayout:
        """The same layout with its index and position tensors on `device`."""
        return PackedLayout(
            token_tags=self.token_tags.to(device),
            position_ids=self.position_ids.to(device),
            video_indices=self.video_indices.to(device),
            audio_indices=self.audio_indices.to(device),
            text_indices=self.text_indices.to(device),
            target_grid=self.target_grid,
        )


class H3Transformer(nn.Module):
    """The MiniMax-H3 DiT. Keys and math match diffusers' `MiniMaxH3Transformer3DModel`."""

    # Declarative capabilities read by generic machinery (offload, parallel, dtype policy).
    repeated_blocks = ("transformer_blocks",)
    # Kept in fp32 whatever the load dtype (matched as whole dotted name components).
    keep_in_fp32_modules = ("proj_in", "audio_proj_in", "time_embedder", "proj_out", "audio_proj_out", "rope")
    # Tensor-parallel plan (h3serve.parallel.tensor_parallel): attention split by heads, the FFN by columns
    # (its fused [value; gate] input as a pair), the per-block AdaLN projection split and all-gathered.
    tensor_parallel_plan = {
        "*.attn.to_q": "colwise",
        "*.attn.to_k": "colwise",
        "*.attn.to_v": "colwise",
        "*.attn.to_out.0": "rowwise",
        "*.attn.to_gate_compress": "colwise",  # VSA's gate: per head, like q
        "*.ff.net.0.proj": "colwise_pair",
        "*.ff.net.2": "rowwise",
        "transformer_blocks.*.adaln_proj.linear": "colwise_gather",
    }

    def __init__(self, cfg: H3TransformerConfig):
        super().__init__()
        if 2 * 3 * cfg.rope_freq_dim > cfg.attention_head_dim:
            raise ValueError(
                f"attention_head_dim ({cfg.attention_head_dim}) must be >= 6·rope_freq_dim ({6 * cfg.rope_freq_dim})"
            )
        self.config = cfg
        d = cfg.hidden_size
        self.proj_in = nn.Linear(cfg.video_patch_dim, d, bias=True)
        self.audio_proj_in = nn.Linear(cfg.audio_in_channels, d, bias=True)
        self.context_embedder = nn.Linear(cfg.text_dim, d, bias=True)
        self.time_embedder = TimestepEmbedder(cfg.freq_dim, cfg.time_embed_hidden_dim, cfg.time_embed_dim)
        self.rope = RotaryEmbedding3D(cfg.rope_freq_dim, cfg.rope_theta)
        self.token_refiner = TokenRefiner(cfg)
        self.transformer_blocks = nn.ModuleList([TransformerBlock(cfg) for _ in range(cfg.num_layers)])
        self.norm_out = AdaLNOut(d, cfg.time_embed_dim, cfg.final_norm_eps)
        self.proj_out = nn.Linear(d, cfg.video_patch_dim, bias=True)
        self.audio_proj_out = nn.Linear(d, cfg.audio_in_channels, bias=True)
        # Set by h3serve.parallel for sequence parallelism: splits the rows before the blocks, gathers after.
        self.sequence_parallel: SequenceSharder | None = None
        # Set per request by an adapter (h3serve.rank.lora): step-dependent output heads, and the identity of an
        # adapter that changes the AdaLN projections ("" for none): the AdaLN memo keys its tables by it.
        self.step_heads: StepHeads | None = None
        self.adaln_adapter = ""
        # Set at load by `--controlnet-model-path` (h3serve.model.controlnet): the control branch; a request's
        # `control` rows feed it. None: no control served.
        self.controlnet: nn.Module | None = None
        # Set per request by a step cache (h3serve.accel.teacache): runs or skips the block loop. None: it runs.
        self.block_loop: BlockLoop | None = None
        # Set at load when the blocks' attention core is sparse (h3serve.accel.attention.install): it reads each
        # forward's layout (which rows are the target video) before the blocks run. None: dense cores.
        self.sparse_attention: SparseAttention | None = None

    def add_sparse_gates(self, bias: bool) -> None:
        """Give every transformer block's attention VSA's gate projection (a FastH3 V2 checkpoint carries them)."""
        for block in self.transformer_blocks:
            block.attn.add_sparse_gate(bias)

    def fuse_projections(self) -> None:
        """Fuse every attention's Q/K/V projections (see `Attention.fuse_qkv`); the state dict then has
        `attn.to_qkv` keys instead of diffusers' three. The feed-forward's [value; gate] is fused already."""
        for module in self.modules():
            if isinstance(module, Attention) and module.to_qkv is None:
                module.fuse_qkv()

    def embed_text(self, text: torch.Tensor) -> torch.Tensor:
        """Text encoder states [B, L, text_dim] -> refined rows [B, L, D].

        Depends only on the prompt, so the pipeline computes it once per request, not once per step.
        """
        return self.token_refiner(self.context_embedder(text.to(compute_dtype(self.context_embedder))))

    def run_blocks(
        self,
        x: torch.Tensor,  # [B, S, D] (this rank's rows under sequence parallelism)
        temb: torch.Tensor | StepModulation,
        adaln_idx: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor],
        hints: Mapping[int, torch.Tensor] | None = None,  # control hints added after the blocks they name
        hint_scale: float | None = None,
    ) -> torch.Tensor:
        """The block loop. A block cache (h3serve.accel.cache, through cache-dit) swaps the block list for its
        cached runner per request; a step cache (`block_loop`) decides whether this runs at all."""
        for index, block in enumerate(self.transformer_blocks):
            x = block(x, temb, adaln_idx, rotary)
            if hints and index in hints:
                x = x + hints[index] * hint_scale
        return x

    def forward(
        self,
        video: torch.Tensor,  # [B, Nv, C·4] patchified video rows, in video_indices order
        audio: torch.Tensor,  # [B, Na, 32] audio rows, in audio_indices order
        text: torch.Tensor,  # [B, L, D] from embed_text()
        timestep: torch.Tensor,  # [T] distinct timesteps in [0, 1]
        timestep_indices: torch.Tensor,  # [S] row -> index into `timestep`
        layout: PackedLayout,
        modulation: StepModulation | None = None,  # precomputed for this step's `timestep` (adaln_memo)
        step: int | None = None,  # the request's denoise step: picks `step_heads` rows when an adapter set them
        control: ControlRows | None = None,  # a control video's rows and scale (h3serve.model.controlnet)
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Velocities of every video and audio row: ([B, Nv, C·4], [B, Na, 32]), fp32."""
        rotary = self.rope(layout.position_ids)
        v = self.proj_in(video.to(self.proj_in.weight.dtype))
        a = self.audio_proj_in(audio.to(self.audio_proj_in.weight.dtype))

        # Pack: text sets the residual stream's dtype; no padding and no mask (one attention document).
        x = text.new_zeros((text.shape[0], layout.seq_len, text.shape[-1]))
        x = x.index_copy(1, layout.text_indices, text)
        x = x.index_copy(1, layout.video_indices, v.to(text.dtype))
        x = x.index_copy(1, layout.audio_indices, a.to(text.dtype))

        adaln_idx = timestep_indices * NUM_MODALITIES + layout.token_tags
        if self.sparse_attention is not None:
            self.sparse_attention.prepare(layout)
        hints: Mapping[int, torch.Tensor] = {}
        if control is not None and control.scale != 0 and self.controlnet is not None:
            # The control blocks compute their own AdaLN tables from the time embedding (the memo holds the
            # main blocks' only); their hints are added after the main blocks they name. Scale 0: no branch at all.
            hints = self.controlnet.hints(x, control, layout, self.time_embedder(timestep), adaln_idx, rotary)
        if modulation is None:
            temb: torch.Tensor | StepModulation = self.time_embedder(timestep)  # [T, E], fp32
            out_mod = self.norm_out.modulation(temb)
        else:  # the blocks read the precomputed tables; the time embedding is not needed
            temb, out_mod = modulation, modulation.output
            adaln_idx = modulation.slots.index_select(0, adaln_idx)
        sp = self.sequence_parallel
        if sp is not None:  # each rank runs the blocks on its own chunk of the rows (attention sees them all)
            if hints:
                raise RuntimeError("a control video with sequence parallelism (refused at start-up)")
            x, adaln_idx, rotary = sp.shard(x, adaln_idx, rotary)
        if self.block_loop is not None:
            if hints:
                raise RuntimeError("a control video under a step cache (refused at start-up)")
            x = self.block_loop(self, x, temb, adaln_idx, rotary)
        else:
            x = self.run_blocks(x, temb, adaln_idx, rotary, hints, None if control is None else control.scale)
        if sp is not None:
            x = sp.gather(x)

        # The output norm is per-row, so only the video and audio rows need it: text rows are dropped first.
        head_dtype = self.proj_out.weight.dtype
        v_rows = self.norm_out.apply(
            x.index_select(1, layout.video_indices), out_mod, timestep_indices[layout.video_indices]
        )
        a_rows = self.norm_out.apply(
            x.index_select(1, layout.audio_indices), out_mod, timestep_indices[layout.audio_indices]
        )
        heads = self.step_heads
        if heads is not None and step is not None:
            video = F.linear(v_rows.float(), heads.video_weight[step], heads.video_bias[step])
            return video, F.linear(a_rows.float(), heads.audio_weight[step], heads.audio_bias[step])
        return self.proj_out(v_rows.to(head_dtype)), self.audio_proj_out(a_rows.to(head_dtype))
