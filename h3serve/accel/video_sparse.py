"""Video sparse attention (VSA), FastVideo's definition, on H3's packed sequence: an attention backend for the DiT's
blocks (`--diffusion-attention-backend FASTVIDEO_VSA`; the FastH3 8-step V2 checkpoint runs on it).

The rows are grouped into tiles of at most 64 (`TilePlan`): the target video's latent rows in 4×4×4 cubes of
(frame, row, column) — edge cubes hold fewer —, every other row (text, conditions, audio) in runs of 64 in packed
order. Per head:

1. coarse attention: q, k and v averaged over each tile's rows, softmax(q̄ k̄ᵀ / √d) over the tiles, times v̄: one
   output per tile, broadcast to the tile's rows;
2. top-k selection: each query tile keeps the k key tiles its coarse scores rank highest (k = ⌈(1 − sparsity)·N⌉
   of N tiles, or a fixed count);
3. block-sparse fine attention: each row attends to the rows of its tile's selected key tiles only;
4. gated combination: fine + gate ⊙ coarse, the gate a learned per-row projection of the block's attention input
   (`attn.to_gate_compress`, FastH3 V2's); a DiT without one has gate 0, so its VSA is the fine branch alone —
   exactly dense attention when k covers every tile.

Two paths compute it: `vsa_reference`, plain torch in float32 in packed row order (any device; the CPU path), and
`vsa_flex`, FlexAttention with a block mask on the tile-ordered sequence (the CUDA path: compiled, it skips every
unselected 64×64 block; eager it runs anywhere, materialising the scores). Both share the tiling, the coarse branch
and the selection, so they differ by the fine branch's rounding only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

TILE_ROWS = 64
CUBE = (4, 4, 4)  # frames, rows, columns of one video tile
DEFAULT_SPARSITY = 0.8  # FastH3 V2's
_CHUNK_ELEMENTS = 1 << 24  # the reference's fine-branch score block (elements of fp32): bounded memory per step


@dataclass(frozen=True)
class TilePlan:
    """How the packed rows group into tiles: `slots` [N, 64] holds each tile's packed row indices, valid ones first
    (`sizes` of them), then -1; `tile_of_row` [S] is each row's tile."""

    slots: torch.Tensor
    sizes: torch.Tensor
    tile_of_row: torch.Tensor
    seq_len: int

    @property
    def num_tiles(self) -> int:
        return self.slots.shape[0]

    def to(self, device: torch.device) -> TilePlan:
        return TilePlan(self.slots.to(device), self.sizes.to(device), self.tile_of_row.to(device), self.seq_len)


def tile_plan(seq_len: int, target_grid: tuple[int, int, int] | None = None) -> TilePlan:
    """The tiles of a packed sequence of `seq_len` rows whose last F·H·W rows are the target video's latent rows
    (frame-major, then row, column: `target_grid` = (F, H, W)); None: no video, every row in runs of 64."""
    frames, rows, cols = target_grid or (0, 0, 0)
    video = frames * rows * cols
    prefix = seq_len - video
    if prefix < 0:
        raise ValueError(f"a target grid of {video} rows in a sequence of {seq_len}")
    runs = -(-prefix // TILE_ROWS)
    head = F.pad(torch.arange(prefix), (0, runs * TILE_ROWS - prefix), value=-1).reshape(runs, TILE_ROWS)
    ft, rt, ct = (-(-n // c) for n, c in zip((frames, rows, cols), CUBE, strict=True))
    grid = torch.arange(prefix, seq_len).reshape(frames, rows, cols)
    grid = F.pad(grid, (0, ct * 4 - cols, 0, rt * 4 - rows, 0, ft * 4 - frames), value=-1)
    cubes = grid.reshape(ft, 4, rt, 4, ct, 4).permute(0, 2, 4, 1, 3, 5).reshape(-1, TILE_ROWS)
    slots = torch.cat([head, cubes])
    # Valid rows first in each tile, in their order (a stable sort on "is padding").
    order = torch.sort((slots < 0).to(torch.int8), dim=1, stable=True).indices
    slots = slots.gather(1, order)
    sizes = (slots >= 0).sum(1)
    tile_of_row = torch.empty(seq_len, dtype=torch.long)
    valid = slots >= 0
    tile_of_row[slots[valid]] = torch.arange(slots.shape[0]).repeat_interleave(sizes)
    return TilePlan(slots, sizes, tile_of_row, seq_len)


def topk_tiles(num_tiles: int, sparsity: float = DEFAULT_SPARSITY, fixed: int | None = None) -> int:
    """How many key tiles each query tile keeps: `fixed` (capped at N), else ⌈(1 − sparsity)·N⌉, at least 1."""
    k = fixed if fixed is not None else math.ceil((1.0 - sparsity) * num_tiles)
    return max(1, min(num_tiles, k))


def _tiled(x: torch.Tensor, plan: TilePlan) -> torch.Tensor:
    """[B, S, H, D] -> [B, H, N, 64, D] in tile order, padding slots zero."""
    padded = F.pad(x, (0, 0, 0, 0, 0, 1))  # a zero row at index S for the padding slots
    index = torch.where(plan.slots < 0, plan.seq_len, plan.slots).flatten()
    return padded[:, index].unflatten(1, (plan.num_tiles, TILE_ROWS)).permute(0, 3, 1, 2, 4)


@dataclass(frozen=True)
class CoarseAttention:
    """The coarse branch of one attention call: tile scores [B, H, N, N] (fp32 probabilities), its output per tile
    [B, H, N, D] (fp32) and the selected key tiles [B, H, N, k]."""

    scores: torch.Tensor
    output: torch.Tensor
    selected: torch.Tensor


def coarse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: TilePlan, topk: int) -> CoarseAttention:
    """Steps 1 and 2 on q, k, v [B, S, H, D]: tile means, their attention, and each query tile's top-k key tiles."""
    sizes = plan.sizes.to(q.device, torch.float32)[None, None, :, None]
    qc, kc, vc = (_tiled(t, plan).float().sum(3) / sizes for t in (q, k, v))  # [B, H, N, D]
    scores = torch.softmax(qc @ kc.transpose(-1, -2) * q.shape[-1] ** -0.5, dim=-1)
    selected = scores.topk(topk, dim=-1).indices.sort(dim=-1).values
    return CoarseAttention(scores, scores @ vc, selected)


def _combine(fine: torch.Tensor, coarse: CoarseAttention, plan: TilePlan, gate: torch.Tensor | None) -> torch.Tensor:
    """Step 4: fine [B, S, H, D] (fp32) + gate ⊙ the coarse output of each row's tile, in q's dtype by the caller."""
    if gate is None:
        return fine
    per_row = coarse.output[:, :, plan.tile_of_row.to(fine.device)].transpose(1, 2)  # [B, S, H, D]
    return fine + gate.float() * per_row


def _allowed(coarse: CoarseAttention) -> torch.Tensor:
    """[B, H, N, N] bool: query tile -> key tiles it attends to."""
    b, h, n, _ = coarse.scores.shape
    return torch.zeros(b, h, n, n, dtype=torch.bool, device=coarse.scores.device).scatter_(-1, coarse.selected, True)


def vsa_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: TilePlan, topk: int, gate: torch.Tensor | None = None
) -> torch.Tensor:
    """VSA in plain torch, float32, in packed row order: q, k, v (and the gate) [B, S, H, D] -> [B, S, H, D].

    The fine branch is softmax attention over each row's allowed keys (its tile's selected tiles) in packed key
    order; with every tile selected nothing is masked, and it is `dense_reference` exactly."""
    coarse = coarse_attention(q, k, v, plan, topk)
    allowed = _allowed(coarse)
    tile = plan.tile_of_row.to(q.device)
    qf, kf, vf = (t.float().transpose(1, 2) for t in (q, k, v))  # [B, H, S, D]
    b, h, s, _ = qf.shape
    keys_allowed = allowed[:, :, :, tile]  # [B, H, N, S]: query tile -> allowed key rows
    fine = torch.empty_like(qf)
    step = max(1, _CHUNK_ELEMENTS // max(1, b * h * s))
    for start in range(0, s, step):
        rows = slice(start, min(s, start + step))
        mask = keys_allowed[:, :, tile[rows]]  # [B, H, c, S]
        fine[:, :, rows] = _attend(qf[:, :, rows], kf, vf, mask)
    return _combine(fine.transpose(1, 2), coarse, plan, gate).to(q.dtype)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Softmax attention in fp32 [B, H, c, D] against [B, H, S, D]; `mask` True where a key may be attended."""
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def dense_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Dense attention by the same float32 arithmetic as `vsa_reference`'s fine branch: [B, S, H, D] in and out."""
    qf, kf, vf = (t.float().transpose(1, 2) for t in (q, k, v))
    b, h, s, _ = qf.shape
    out = torch.empty_like(qf)
    step = max(1, _CHUNK_ELEMENTS // max(1, b * h * s))
    for start in range(0, s, step):
        rows = slice(start, min(s, start + step))
        out[:, :, rows] = _attend(qf[:, :, rows], kf, vf, None)
    return out.transpose(1, 2).to(q.dtype)


_COMPILED_FLEX = None


def _flex_kernel(device: torch.device):
    """FlexAttention: compiled on CUDA (the fused block-sparse kernel, built once per process), eager elsewhere."""
    from torch.nn.attention.flex_attention import flex_attention

    global _COMPILED_FLEX
    if device.type != "cuda":
        return flex_attention
    if _COMPILED_FLEX is None:
        _COMPILED_FLEX = torch.compile(flex_attention, dynamic=True)
    return _COMPILED_FLEX


def block_mask(coarse: CoarseAttention, plan: TilePlan):
    """The FlexAttention `BlockMask` of the selection on the tile-ordered sequence (64-row blocks): selected tiles
    without padding are full blocks (no per-element mask), selected tiles with padding are partial ones whose
    `mask_mod` masks the padding keys; `mask_mod` also carries the selection, so an eager (unfused) run that
    evaluates it everywhere computes the same."""
    from torch.nn.attention.flex_attention import BlockMask

    b, h, n, k = coarse.selected.shape
    device = coarse.selected.device
    sizes = plan.sizes.to(device)
    whole = (sizes == TILE_ROWS)[coarse.selected]  # [B, H, N, k]: the selected tile has no padding

    def front(keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(count, indices [B, H, N, N]) of the selected tiles where `keep`, first in tile order (rest ignored)."""
        order = torch.sort((~keep).to(torch.int8), dim=-1, stable=True).indices  # stable: tile order kept
        indices = torch.zeros(b, h, n, n, dtype=torch.int32, device=device)
        indices[..., :k] = coarse.selected.gather(-1, order).to(torch.int32)
        return keep.sum(-1).to(torch.int32), indices

    full_count, full_indices = front(whole)
    partial_count, partial_indices = front(~whole)
    allowed = _allowed(coarse)
    valid = (torch.arange(TILE_ROWS, device=device)[None, :] < sizes[:, None]).flatten()  # [N·64]

    def mask_mod(bi, hi, q_idx, kv_idx):
        return allowed[bi, hi, q_idx // TILE_ROWS, kv_idx // TILE_ROWS] & valid[kv_idx]

    length = n * TILE_ROWS
    return BlockMask.from_kv_blocks(partial_count, partial_indices, full_count, full_indices, BLOCK_SIZE=TILE_ROWS,
                                    mask_mod=mask_mod, seq_lengths=(length, length))


def vsa_flex(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: TilePlan, topk: int, gate: torch.Tensor | None = None
) -> torch.Tensor:
    """VSA with the fine branch as FlexAttention over 64-row blocks: q, k, v (and the gate) [B, S, H, D] ->
    [B, S, H, D]. The same tiles, coarse branch and selection as `vsa_reference`."""
    coarse = coarse_attention(q, k, v, plan, topk)
    tiled = [_tiled(t, plan).flatten(2, 3) for t in (q, k, v)]  # [B, H, N·64, D]
    attended = _flex_kernel(q.device)(*tiled, block_mask=block_mask(coarse, plan))  # [B, H, N·64, D]
    valid = plan.slots.flatten() >= 0
    rows = plan.slots.flatten()[valid].to(q.device)
    fine = torch.empty(q.shape[0], plan.seq_len, q.shape[2], q.shape[3], dtype=torch.float32, device=q.device)
    fine[:, rows] = attended[:, :, valid.to(q.device)].transpose(1, 2).float()
    return _combine(fine, coarse, plan, gate).to(q.dtype)


@dataclass(frozen=True)
class SparseSettings:
    """How many key tiles each query tile keeps: ⌈(1 − sparsity)·N⌉, or `topk` tiles when given (vLLM-Omni's
    `--fastvideo-vsa-topk`)."""

    sparsity: float = DEFAULT_SPARSITY
    topk: int | None = None


class VideoSparseAttention:
    """The `SparseAttention` core of one DiT's blocks (h3serve.model.transformer): `prepare` tiles each forward's
    layout (cached while the shape stays), every block's call runs VSA on it. `kernel`: "reference" (plain torch,
    any device) or "flex" (FlexAttention block masks; compiled on CUDA)."""

    def __init__(self, settings: SparseSettings, kernel: str):
        if kernel not in ("reference", "flex"):
            raise ValueError(f"VSA kernel must be 'reference' or 'flex', got {kernel!r}")
        self.settings = settings
        self.kernel = kernel
        self.plan: TilePlan | None = None
        self.topk = 0
        self._shape: tuple | None = None

    def prepare(self, layout) -> None:
        """Tile the forward's packed rows (a `PackedLayout`: its length and target video grid)."""
        device = layout.token_tags.device
        shape = (layout.seq_len, layout.target_grid, device)
        if shape != self._shape:
            self.plan = tile_plan(layout.seq_len, layout.target_grid).to(device)
            self.topk = topk_tiles(self.plan.num_tiles, self.settings.sparsity, self.settings.topk)
            self._shape = shape

    @torch.compiler.disable  # an eager island between compiled blocks: data-dependent top-k and gathers
    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gate: torch.Tensor | None = None
    ) -> torch.Tensor:
        if self.plan is None or self.plan.seq_len != q.shape[1]:
            raise RuntimeError("video sparse attention called before the DiT prepared this forward's tiles")
        run = vsa_flex if self.kernel == "flex" else vsa_reference
        return run(q, k, v, self.plan, self.topk, gate)
