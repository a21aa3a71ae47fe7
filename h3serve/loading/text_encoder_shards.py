"""The text encoder under text-encoder tensor parallelism: each of the first N ranks reads only its shard of
Qwen3-VL's language model from the safetensors (h3serve.parallel.text_encoder_tp shards and runs it); the other
ranks keep a weightless skeleton."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from h3serve.accel.quantize import prepare_fp8, quantizing
from h3serve.checkpoint.resolver import CheckpointError, safetensors_files
from h3serve.checkpoint.text_encoder_names import checkpoint_key_to_name, checkpoint_module_names
from h3serve.loading.tensors import materialize
from h3serve.model.text_encoder import TextConditioner
from h3serve.parallel.setup import RankParallel
from h3serve.parallel.tensor_parallel import TensorParallel, iter_sharded
from h3serve.parallel.text_encoder_tp import ParallelTextConditioner


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


def load_parallel_text_conditioner(
    parallel: RankParallel,
    folder: Path,
    tokenizer_folder: Path,
    dtype: torch.dtype,
    device: torch.device,
    load_whole: Callable[..., TextConditioner],
    load_device: torch.device | None = None,
    quantize: Callable | None = None,
    kernel: str = "weight_only",
):
    """The text conditioner on a multi-rank engine: weights load onto `load_device` (host memory under offload,
    default `device`); the hidden states every rank receives live on `device`. `load_whole` is the unsharded
    loader (h3serve.loading.components), used where this rank runs the encoder whole; `quantize` (FP8) runs on a
    loaded shard before it moves to `load_device`; stored FP8 linears load on the `kernel` path."""
    load_device = load_device or device
    from transformers import AutoConfig, AutoTokenizer

    from h3serve.rules import limits

    if parallel.runs_encoder_whole:
        whole = load_whole(folder, tokenizer_folder, dtype, load_device)
        model, tokenizer = whole.model, whole.tokenizer
    else:  # a TP shard, or a weightless skeleton on the ranks that do not run the encoder
        config = AutoConfig.from_pretrained(folder)
        config.text_config.num_hidden_layers = limits.TEXT_ENCODER_LAYER + 1  # as the unsharded loader
        model = load_text_encoder_shard(folder, config, dtype, load_device, parallel.text_tp, quantize, kernel)
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_folder)
    return ParallelTextConditioner(
        model,
        tokenizer,
        limits.TEXT_ENCODER_LAYER,
        runs_encoder=parallel.runs_text_encoder,
        out_device=device,
        out_dtype=dtype,
    )
