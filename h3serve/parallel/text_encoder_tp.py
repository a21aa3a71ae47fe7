"""Text-encoder tensor parallelism: Qwen3-VL's language model sharded over the first N ranks.

Ranks [0, N) build the encoder on the meta device, shard its attention (by query and KV heads) and MLP
linears, and read only their slices from safetensors; the vision tower is small and stays whole. The other
ranks keep a weightless (meta) skeleton and read nothing. At encode time the first N ranks run the encoder
(their all-reduces stay inside the text-encoder group) and rank 0's hidden states are broadcast to every rank,
so all ranks condition the DiT on bit-identical states.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from h3serve.model.text_encoder import TextConditioner

# Names relative to `Qwen3VLModel`. HF's attention derives the head count from the projection's width
# (`view(..., -1, head_dim)`), and heads and KV heads shrink by the same factor, so the GQA ratio is unchanged.
TEXT_ENCODER_TP_PLAN: dict[str, str] = {
    "language_model.layers.*.self_attn.q_proj": "colwise",
    "language_model.layers.*.self_attn.k_proj": "colwise",
    "language_model.layers.*.self_attn.v_proj": "colwise",
    "language_model.layers.*.self_attn.o_proj": "rowwise",
    "language_model.layers.*.mlp.gate_proj": "colwise",
    "language_model.layers.*.mlp.up_proj": "colwise",
    "language_model.layers.*.mlp.down_proj": "rowwise",
}


class ParallelTextConditioner(TextConditioner):
    """A `TextConditioner` whose encoder runs on the text-encoder group and whose output every rank receives."""

    def __init__(
        self,
        model: nn.Module,
        tokenizer,
        layer: int,
        *,
        runs_encoder: bool,
        out_device: torch.device,
        out_dtype: torch.dtype,
        world_group: ProcessGroup | None = None,
    ):
        super().__init__(model, tokenizer, layer)
        self.runs_encoder = runs_encoder
        self.out_device, self.out_dtype = out_device, out_dtype
        self.world_group = world_group
        self.hidden_size = model.config.text_config.hidden_size

    @property
    def device(self) -> torch.device:
        return self.out_device

    @property
    def dtype(self) -> torch.dtype:
        return self.out_dtype

    @torch.no_grad()
    def run(self, ids: list[int], vision: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        """The sharded forward on the first N ranks, rank 0's states broadcast to all (a prompt-cache hit skips this
        on every rank at once: each rank's cache saw the same requests)."""
        if self.runs_encoder:
            states = super().run(ids, vision).to(self.out_dtype).contiguous()
        else:  # the shape is known everywhere: L = len(ids) tokens of the encoder's width
            states = torch.empty((1, len(ids), self.hidden_size), dtype=self.out_dtype, device=self.out_device)
        # Every rank reaches this broadcast exactly once per encode; ranks outside the text-encoder group skip
        # straight to it, which is safe because their only collective here is this one.
        dist.broadcast(states, src=0, group=self.world_group)
        return states
