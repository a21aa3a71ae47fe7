"""Fun ControlNet Union for H3 (Alibaba PAI's `MiniMax-H3-Fun-Controlnet-Union`, as vLLM-Omni serves it).

A control branch beside the DiT: `control_proj_in` embeds each video token's 196 control columns (96 control-video
latents | 4 visibility from the mask | 96 masked-source latents, each part patchified 1x2x2) into the residual
stream in place of the token's own embedding; `before_proj` of that, plus the stream, enters `n` DiT-shaped control
blocks run with the main blocks' timesteps and rotary; after each one `after_proj` gives a hint (audio rows zeroed,
text rows kept) that the main DiT adds after its block `places[i]`, times the request's `control_context_scale`.

The released file has 5 control blocks over 50 main blocks, at 0, 10, 20, 30, 40: `places` are every
`num_layers // n` blocks from 0 (a smaller DiT's file with fewer blocks spreads them alike).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from h3serve.model.layout import patchify
from h3serve.model.transformer import PackedLayout, TransformerBlock
from h3serve.model.transformer_config import H3TransformerConfig

CONTROL_COLUMNS = 196  # (24 control + 1 visibility + 24 source channels) x 2x2 patches
LATENT_COLUMNS = 96  # one 24-channel latent, patchified


def control_places(num_layers: int, blocks: int) -> tuple[int, ...]:
    """After which main blocks the hints are added: every `num_layers // blocks` from 0."""
    if not 1 <= blocks <= num_layers:
        raise ValueError(f"{blocks} control blocks for a DiT of {num_layers} blocks")
    step = num_layers // blocks
    return tuple(i * step for i in range(blocks))


class ControlBlock(TransformerBlock):
    """A DiT block plus `after_proj` (the hint it gives) and, for the first, `before_proj` (the stream's entry)."""

    def __init__(self, cfg: H3TransformerConfig, first: bool):
        super().__init__(cfg)
        d = cfg.hidden_size
        self.before_proj = nn.Linear(d, d, bias=True) if first else None
        self.after_proj = nn.Linear(d, d, bias=True)


@dataclass(frozen=True)
class ControlInput:
    """One request's control: rows [B, Nv, 196] in video-row order (fp32) and the scale of its hints."""

    rows: torch.Tensor
    scale: float


class ControlNet(nn.Module):
    def __init__(self, cfg: H3TransformerConfig, blocks: int):
        super().__init__()
        self.places = control_places(cfg.num_layers, blocks)
        self.control_proj_in = nn.Linear(CONTROL_COLUMNS, cfg.hidden_size, bias=True)  # fp32 (the release's)
        self.control_blocks = nn.ModuleList([ControlBlock(cfg, i == 0) for i in range(blocks)])

    def hints(
        self,
        x: torch.Tensor,  # [B, S, D] the packed stream entering the main blocks
        control: ControlInput,
        layout: PackedLayout,
        temb: torch.Tensor,  # [T, E] the step's time embedding
        adaln_idx: torch.Tensor,  # [S]
        rotary: tuple[torch.Tensor, torch.Tensor],
    ) -> dict[int, torch.Tensor]:
        """Main block index -> the hint [B, S, D] added after it (not yet scaled)."""
        rows = control.rows.to(self.control_proj_in.weight.device, torch.float32).expand(x.shape[0], -1, -1)
        embeds = self.control_proj_in(rows.to(self.control_proj_in.weight.dtype))  # [B, Nv, D]
        stream = x.index_copy(1, layout.video_indices, embeds.to(x.dtype))
        first = self.control_blocks[0]
        assert first.before_proj is not None
        stream = first.before_proj(stream) + x
        hints = {}
        for place, block in zip(self.places, self.control_blocks, strict=True):
            stream = block(stream, temb, adaln_idx, rotary)
            hints[place] = block.after_proj(stream).index_fill(1, layout.audio_indices, 0.0)
        return hints


def control_rows(
    control: torch.Tensor | None,  # [1, 24, F, h, w] normalised control-video latents; None: zeros
    visible: torch.Tensor | None,  # [1, 1, F, h, w] 1 - mask on the latent grid; None: no mask
    source: torch.Tensor | None,  # [1, 24, F, h, w] the masked source's latents (with a mask)
    latent_shape: tuple[int, int, int],  # (F, h, w) of the generated video
) -> torch.Tensor:
    """The 196 control columns of every video token, [1, F·h/2·w/2, 196] fp32: control latents | visibility |
    masked-source latents, each patchified alone. Without a mask the last 100 columns are zero."""
    if control is None and visible is None:
        raise ValueError("a control needs a control video or a mask")
    parts = []
    for latents, channels in ((control, 24), (visible, 1), (source, 24)):
        if latents is not None and tuple(latents.shape[2:]) != latent_shape:
            raise ValueError(f"control latents {tuple(latents.shape[2:])} on a {latent_shape} latent grid")
        if latents is None:
            latents = torch.zeros((1, channels, *latent_shape))
        parts.append(patchify(latents.float()))
    rows = torch.cat(parts, dim=-1)
    if visible is None:
        rows[:, LATENT_COLUMNS:] = 0
    return rows[None]
