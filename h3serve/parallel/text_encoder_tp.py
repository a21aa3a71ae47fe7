"""Text-encoder tensor parallelism: Qwen3-VL's language model sharded over the first N ranks.

Ranks [0, N) build the encoder on the meta device, shard its attention (by query and KV heads) and MLP
linears, and read only their slices from safetensors; the vision tower is small and stays whole. The other
ranks keep a weightless (meta) skeleton and read nothing. At encode time the first N ranks run the encoder
(their all-reduces stay inside the text-encoder group) and rank 0's hidden states are broadcast to every rank,
so all ranks condition the DiT on bit-identical states.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from h3serve.accel.quantize import prepare_fp8, quantizing
from h3serve.checkpoint.resolver import CheckpointError, safetensors_files
from h3serve.checkpoint.weights import materialize
from h3serve.model.text_encoder import TextConditioner
from h3serve.parallel.tensor_parallel import TensorParallel, iter_sharded

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


def checkpoint_key_to_name(key: str, num_layers: int) -> str | None:
    """A Qwen3-VL checkpoint key -> its `Qwen3VLModel` parameter name; None for what is never loaded (the LM
    head, decoder layers past `num_layers`). Both the current (`model.language_model.*`, `model.visual.*`) and
    the older (`model.layers.*`, `visual.*`) layouts are read."""
    if key.startswith("lm_head."):
        return None
    if key.startswith(("model.language_model.", "model.visual.")):
        name = key[len("model.") :]
    elif key.startswith("model."):
        name = "language_model." + key[len("model.") :]
    elif key.startswith("visual."):
        name = key
    else:
        raise CheckpointError(f"unexpected text-encoder weight {key!r}")
    if name.startswith("language_model.layers."):
        if int(name.split(".")[2]) >= num_layers:
            return None
    return name


def checkpoint_module_names(num_layers: int) -> Callable[[str], tuple[str, ...]]:
    """A checkpoint module name -> the `Qwen3VLModel` module it is (none for what is never loaded)."""

    def rename(module: str) -> tuple[str, ...]:
        name = checkpoint_key_to_name(f"{module}.weight", num_layers)
        return () if name is None else (name[: -len(".weight")],)

    return rename


def _rebuild_meta_buffers(model: nn.Module, init: Callable[[nn.Module], None], device: torch.device) -> None:
    """Non-persistent buffers (RoPE frequencies) are not in the checkpoint: allocate and recompute them."""
    for module in model.modules():
        if any(b.is_meta for b in module.buffers(recurse=False)):
            module.to_empty(device=device, recurse=False)
            with torch.no_grad():
                init(module)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise CheckpointError(f"text encoder: {len(left)} tensors were not loaded, e.g. {left[0]}")


def load_text_encoder_shard(
    folder: Path,
    config,
    dtype: torch.dtype,
    device: torch.device,
    tp: TensorParallel | None,
    quantize: Callable[[nn.Module, torch.device, TensorParallel | None], object] | None = None,
    kernel: str = "weight_only",
) -> nn.Module:
    """`Qwen3VLModel` for `config` (already truncated): this rank's TP shard, or a meta skeleton when `tp` is None.
    `quantize` (FP8) runs on the shard loaded in host memory, which then moves to `device`. Linears the checkpoint
    stores in FP8 load their stored rows and scales (`kernel` path), never re-quantised."""
    from transformers import Qwen3VLModel

    with torch.device("meta"):
        model = Qwen3VLModel._from_config(config, dtype=dtype)
    if tp is None:
        return model.eval()
    tp.shard_module(model)
    num_layers = config.text_config.num_hidden_layers
    files = safetensors_files(folder)
    tensors = iter_sharded(files, tp, lambda key: checkpoint_key_to_name(key, num_layers))
    host = torch.device("cpu") if quantize is not None else device
    fp8 = prepare_fp8(model, "text_encoder", None, files, dtype, kernel, checkpoint_module_names(num_layers))
    if fp8 is not None:
        tensors = quantizing(tensors, fp8, host, tp)
    materialize(model, tensors, dtype, host, stored=fp8.stored if fp8 is not None else frozenset())
    _rebuild_meta_buffers(model, model._init_weights, host)
    if quantize is not None:
        quantize(model, device, tp)
        model.to(device)
    return model.eval()


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
