"""Analytic DiT FLOPs (GEMMs + attention, 2 FLOPs per multiply-add) and a hook-based counter of what ran.

Per transformer block over S packed rows (D hidden, I = heads·head_dim inner, F FFN):
  Q, K, V, out projections 8·S·D·I; attention scores and values 4·S²·I; SwiGLU FFN 6·S·D·F.
Outside the blocks: patch/audio projections in and out, the timestep MLP and AdaLN tables (per distinct timestep).
The text embedding (context embedder + token refiner over the L text rows) is counted separately, each time it
runs: h3serve runs it once per request, the diffusers reference once per forward.
Norms, RoPE, activations and the sampler are elementwise and left out (well under 1% here).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import nn

from h3serve.model.transformer import NUM_MODALITIES, H3TransformerConfig


@dataclass(frozen=True)
class ForwardShape:
    """The sizes one DiT forward ran on (batch 1)."""

    video_rows: int
    audio_rows: int
    text_rows: int
    timesteps: int  # distinct timesteps (rows of the AdaLN tables)

    @property
    def seq_len(self) -> int:
        return self.video_rows + self.audio_rows + self.text_rows


def _attention_block(cfg: H3TransformerConfig, rows: int) -> float:
    """One pre-norm attention + SwiGLU block over `rows` rows (no AdaLN)."""
    d, inner = cfg.hidden_size, cfg.inner_dim
    return 8.0 * rows * d * inner + 4.0 * rows * rows * inner + 6.0 * rows * d * cfg.ffn_dim


def forward_flops(cfg: H3TransformerConfig, s: ForwardShape) -> float:
    """FLOPs of one DiT forward, excluding the text embedding."""
    d, e = cfg.hidden_size, cfg.time_embed_dim
    blocks = cfg.num_layers * (_attention_block(cfg, s.seq_len) + 2.0 * s.timesteps * e * 6 * d * NUM_MODALITIES)
    io = 2.0 * 2 * (s.video_rows * cfg.video_patch_dim * d + s.audio_rows * cfg.audio_in_channels * d)
    time = 2.0 * s.timesteps * (cfg.freq_dim * cfg.time_embed_hidden_dim + cfg.time_embed_hidden_dim * e)
    out_norm = 2.0 * s.timesteps * e * 2 * d  # the output AdaLN's projection, once for the video and audio rows
    return blocks + io + time + out_norm


def text_embed_flops(cfg: H3TransformerConfig, text_rows: int) -> float:
    """FLOPs of the context embedder plus the token refiner over `text_rows` rows."""
    return 2.0 * text_rows * cfg.text_dim * cfg.hidden_size + cfg.num_refiner_layers * _attention_block(cfg, text_rows)


class FlopCounter:
    """Counts the FLOPs of every DiT forward and text embedding that runs, and times each forward, through hooks.

    `shape_of(args, kwargs)` reads a `ForwardShape` from the DiT's forward arguments (each implementation names
    them differently); the token refiner's input is [B, L, D] in both.
    """

    def __init__(self):
        self.forwards = 0
        self.flops = 0.0
        self.shapes: set[ForwardShape] = set()
        self.forward_s: list[float] = []  # wall time of each DiT forward (GPU synchronised)
        self._handles: list = []
        self._start = 0.0

    def reset(self) -> None:
        self.forwards, self.flops, self.shapes, self.forward_s = 0, 0.0, set(), []

    def attach(self, dit: nn.Module, cfg: H3TransformerConfig, shape_of) -> None:
        def sync() -> None:
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                torch.cuda.synchronize()

        def on_forward(_module, args, kwargs) -> None:
            shape = shape_of(args, kwargs)
            self.forwards += 1
            self.shapes.add(shape)
            self.flops += forward_flops(cfg, shape)
            sync()
            self._start = time.perf_counter()

        def after_forward(*_: object) -> None:
            sync()
            self.forward_s.append(time.perf_counter() - self._start)

        def on_text(_module, args) -> None:
            self.flops += text_embed_flops(cfg, args[0].shape[1])

        self._handles.append(dit.register_forward_pre_hook(on_forward, with_kwargs=True))
        self._handles.append(dit.register_forward_hook(after_forward))
        self._handles.append(dit.token_refiner.register_forward_pre_hook(on_text))

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
