"""Per-rank byte inventory of every component, from shapes only: models are built on the meta device, no weight
is ever read.

Bytes count every parameter and buffer a component moves to its device (what `.to(device)` moves), in the dtype
the loaders give it: the compute dtype (bf16 on GPU, fp32 on CPU) except the DiT's `keep_in_fp32_modules`, the
video VAE's `_keep_in_fp32_modules` and its non-persistent buffers, and the whole audio VAE (fp32 by policy).
Each rank holds its tensor-parallel shard of the DiT, and its text-encoder shard (or the whole encoder on rank 0
without text-encoder TP, or nothing).

With `engine="vllm-omni"` the video VAE and the text encoder are counted as vLLM-Omni holds them (all-fp32 VAE;
50 encoder layers, the token embedding cut over the encoder's TP ranks): h3serve.offload.measured_engine.

Each component splits into `base_bytes` (what never streams) and block groups (the repeated blocks a layerwise
offload streams): DiT `token_refiner.refiner_blocks` and `transformer_blocks`; text encoder
`language_model.layers` and `visual.blocks`.
"""

from __future__ import annotations

import copy
import math
import warnings
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import nn

from h3serve.config.quantization_config import ComponentQuant, QuantizationConfig
from h3serve.model.audio_decode import streamline_audio_vae
from h3serve.model.transformer import H3Transformer, H3TransformerConfig
from h3serve.offload.measured_engine import H3SERVE, TEXT_ENCODER_LAYERS, VLLM_OMNI, check_engine
from h3serve.offload.model_configs import RELEASED, checkpoint_configs, released_configs
from h3serve.offload.placement_plan import DIT_GROUPS, RESIDENT_GROUP, TEXT_GROUPS
from h3serve.parallel.degrees import ModelDims, ParallelDegrees
from h3serve.parallel.tensor_parallel import TensorParallel
from h3serve.parallel.text_encoder_tp import TEXT_ENCODER_TP_PLAN

ADALN_GROUP = RESIDENT_GROUP  # transformer_blocks: each holds one adaln_proj
ADALN_OUT = "norm_out.linear."
EMBEDDING = "language_model.embed_tokens.weight"  # the text encoder's token embedding

Stored = dict[str, bool] | None  # module name -> per-channel scales, of linears a checkpoint stores in FP8


@dataclass(frozen=True)
class BlockGroup:
    path: str  # the ModuleList's dotted path inside the component
    block_bytes: tuple[int, ...]  # bytes of each block, in order

    @property
    def total(self) -> int:
        return sum(self.block_bytes)


@dataclass(frozen=True)
class ComponentBytes:
    """One component as one rank holds it."""

    name: str
    params: int  # parameter count of this rank's copy (a TP shard counts its shard)
    base_bytes: int  # parameters and buffers outside the block groups
    groups: tuple[BlockGroup, ...] = ()
    fp8_scratch: int = 0  # the largest FP8 layer's weight dequantised in the compute dtype (weight-only FP8)
    # A DiT's AdaLN projections (inside the counts above): each transformer block's adaln_proj, norm_out.linear.
    adaln_blocks: tuple[int, ...] = ()
    adaln_out: int = 0
    adaln_params: int = 0

    @property
    def total_bytes(self) -> int:
        return self.base_bytes + sum(g.total for g in self.groups)

    @property
    def adaln_bytes(self) -> int:
        return sum(self.adaln_blocks) + self.adaln_out

    def without_adaln(self) -> ComponentBytes:
        """What stays of a DiT when its AdaLN projections live in host memory (kept in the `adaln_*` fields)."""
        groups = tuple(
            BlockGroup(g.path, tuple(b - a for b, a in zip(g.block_bytes, self.adaln_blocks, strict=True)))
            if g.path == ADALN_GROUP
            else g
            for g in self.groups
        )
        return replace(self, base_bytes=self.base_bytes - self.adaln_out, groups=groups)

    def group(self, path: str) -> BlockGroup:
        for g in self.groups:
            if g.path == path:
                return g
        raise KeyError(f"{self.name} has no block group {path!r}")


@dataclass(frozen=True)
class TextShape:
    hidden: int
    layers: int  # decoder layers loaded (hidden_states[50] needs 51)
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int


@dataclass(frozen=True)
class VaeShape:
    decoder_width: int
    decoder_ffn: int  # SwiGLU inner width
    latent_channels: int
    tile: int  # spatial tile, pixels
    encoder_width: int  # first encoder block's channels (the widest full-resolution feature map)


@dataclass(frozen=True)
class Inventory:
    """What each rank holds (component -> bytes; absent: not loaded there) plus the shapes activations need."""

    source: str  # "released" or the checkpoint folder
    degrees: ParallelDegrees
    device_type: str  # "cuda" | "cpu"
    dtype: torch.dtype  # compute dtype
    ranks: tuple[dict[str, ComponentBytes], ...]
    dits: dict[str, H3TransformerConfig]  # loaded DiTs and their configs
    text: TextShape
    vae: VaeShape
    engine: str = H3SERVE  # whose conventions the bytes follow (h3serve.offload.measured_engine)

    @property
    def element_size(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def dims(self) -> ModelDims:
        """The sizes the parallel degrees must divide (as `h3serve.parallel.degrees.read_model_dims`)."""
        cfgs = list(self.dits.values())
        return ModelDims(
            dit_heads=math.gcd(*(c.num_attention_heads for c in cfgs)),
            dit_ffn=math.gcd(*(c.ffn_dim for c in cfgs)),
            dit_hidden=math.gcd(*(c.hidden_size for c in cfgs)),
            text_heads=self.text.heads,
            text_kv_heads=self.text.kv_heads,
        )


# ------------------------------------------------------------------------------------------------------------
# Byte counting on meta modules
def _size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _in_any(name: str, modules: tuple[str, ...]) -> bool:
    # Matched as whole dotted components, as checkpoint.materialize and diffusers do.
    return any(part in modules for part in name.split("."))


def _tensor_bytes(module: nn.Module, dtype_of) -> dict[str, tuple[int, int]]:
    """name -> (numel, bytes) of every parameter and buffer, with `dtype_of(name, tensor, is_param)` the dtype."""
    persistent = set(module.state_dict(keep_vars=True))
    out = {}
    for name, p in module.named_parameters():
        out[name] = (p.numel(), p.numel() * _size(dtype_of(name, p, True)))
    for name, b in module.named_buffers():
        dtype = dtype_of(name, b, name in persistent)
        out[name] = (0, b.numel() * _size(dtype))
    return out


def _split(name: str, tensors: dict[str, tuple[int, int]], groups: tuple[str, ...]) -> ComponentBytes:
    """Sum tensors into the base and per-block totals of each present group."""
    base, params = 0, 0
    blocks: dict[str, dict[int, int]] = {}
    for key, (numel, nbytes) in tensors.items():
        params += numel
        for path in groups:
            if key.startswith(path + "."):
                index = int(key[len(path) + 1 :].split(".")[0])
                per = blocks.setdefault(path, {})
                per[index] = per.get(index, 0) + nbytes
                break
        else:
            base += nbytes
    found = tuple(
        BlockGroup(path, tuple(v for _, v in sorted(blocks[path].items()))) for path in groups if path in blocks
    )
    return ComponentBytes(name=name, params=params, base_bytes=base, groups=found)


def _fp8_swap(
    model: nn.Module, component: str, quant: ComponentQuant | None, dtype: torch.dtype, stored: Stored = None
) -> int:
    """The FP8 twins the loader makes (h3serve.accel.quantize): 1-byte weights plus float32 scales, for the linears
    `quant` selects and those the checkpoint stores in FP8 (`stored`). Returns the bytes of the largest one's weight
    dequantised into `dtype` (0 without FP8 layers)."""
    from h3serve.accel.quantize import selected_linears, swap_to_fp8

    names = {n: quant.per_channel for n in selected_linears(model, component, quant)} if quant else {}
    names.update(stored or {})
    if not names:
        return 0
    layers = swap_to_fp8(model, names, dtype, "weight_only")
    return max((m.weight.numel() for m in layers.values()), default=0) * _size(dtype)


def _stored_dtype(key: str, t: torch.Tensor) -> torch.dtype | None:
    """An FP8 weight's dtype and its scale's (float32), which no load policy changes; None for other tensors."""
    if t.dtype.itemsize == 1 and t.is_floating_point():
        return t.dtype
    return torch.float32 if key.endswith(".weight_scale") else None


def dit_bytes(
    name: str,
    cfg: H3TransformerConfig,
    dtype: torch.dtype,
    tp_size: int = 1,
    quant: ComponentQuant | None = None,
    stored: Stored = None,
    gates: bool | None = None,
) -> ComponentBytes:
    """One rank's DiT (its TP shard when tp_size > 1; every TP rank holds the same bytes), FP8 per `quant`;
    `gates`: the blocks carry VSA gate projections (with a bias: True)."""
    with torch.device("meta"):
        model = H3Transformer(cfg)
        if gates is not None:
            model.add_sparse_gates(gates)
    if tp_size > 1:  # works on the meta device, with no process group
        TensorParallel(0, tp_size, None, H3Transformer.tensor_parallel_plan).shard_module(model)
    scratch = _fp8_swap(model, name, quant, dtype, stored)
    fp32 = H3Transformer.keep_in_fp32_modules

    def dtype_of(key: str, t: torch.Tensor, _persistent: bool) -> torch.dtype:
        if not t.is_floating_point():
            return t.dtype
        if _stored_dtype(key, t) is not None:
            return _stored_dtype(key, t)
        return torch.float32 if _in_any(key, fp32) else dtype

    tensors = _tensor_bytes(model, dtype_of)
    blocks: dict[int, int] = {}
    out = params = 0
    for key, (numel, nbytes) in tensors.items():
        parts = key.split(".")
        if key.startswith(ADALN_GROUP + ".") and parts[2] == "adaln_proj":
            blocks[int(parts[1])] = blocks.get(int(parts[1]), 0) + nbytes
            params += numel
        elif key.startswith(ADALN_OUT):
            out += nbytes
            params += numel
    adaln = tuple(blocks[i] for i in sorted(blocks))
    return replace(
        _split(name, tensors, DIT_GROUPS), fp8_scratch=scratch, adaln_blocks=adaln, adaln_out=out, adaln_params=params
    )


def _diffusers_bytes(name: str, model: nn.Module, dtype: torch.dtype) -> ComponentBytes:
    """diffusers' load policy: parameters and persistent buffers in `dtype` unless in `_keep_in_fp32_modules`;
    non-persistent buffers keep the dtype they were built with (checked against a real bf16 load in the tests)."""
    fp32 = tuple(type(model)._keep_in_fp32_modules or ())

    def dtype_of(key: str, t: torch.Tensor, persistent: bool) -> torch.dtype:
        if not t.is_floating_point() or not persistent:
            return t.dtype
        return torch.float32 if _in_any(key, fp32) else dtype

    return _split(name, _tensor_bytes(model, dtype_of), ())


def vae_bytes(config: dict, dtype: torch.dtype) -> tuple[ComponentBytes, VaeShape]:
    from diffusers import AutoencoderKLMiniMaxH3

    with torch.device("meta"):
        model = AutoencoderKLMiniMaxH3.from_config(config)
    c = model.config
    shape = VaeShape(
        decoder_width=c.decoder_num_attention_heads * c.decoder_attention_head_dim,
        decoder_ffn=c.decoder_ffn_mult * c.decoder_num_attention_heads * c.decoder_attention_head_dim,
        latent_channels=c.latent_channels,
        tile=model.tile_sample_min_height,
        encoder_width=c.block_out_channels[0],
    )
    return _diffusers_bytes("vae", model, dtype), shape


def audio_vae_bytes(config: dict) -> ComponentBytes:
    from diffusers import AutoencoderKLMiniMaxH3Audio

    with warnings.catch_warnings(), torch.device("meta"):
        warnings.filterwarnings("ignore", message=".*weight_norm.*is deprecated", category=FutureWarning)
        model = streamline_audio_vae(AutoencoderKLMiniMaxH3Audio.from_config(config))  # as loaded: norms folded
    # Loaded without a dtype (loading.components): fp32 whatever the engine's dtype.
    return _diffusers_bytes("audio_vae", model, torch.float32)


def text_encoder_bytes(
    config,
    dtype: torch.dtype,
    tp_size: int = 1,
    quant: ComponentQuant | None = None,
    stored: Stored = None,
    engine: str = H3SERVE,
) -> ComponentBytes:
    """The truncated `Qwen3VLModel` (no LM head) the conditioner loads; a TP shard when tp_size > 1; FP8 per
    `quant`. As vLLM-Omni holds it (`engine`): TEXT_ENCODER_LAYERS decoder layers and the token embedding cut over
    the tp_size ranks (its `MiniMaxH3Qwen3VLVocabParallelEmbedding`)."""
    from transformers import Qwen3VLModel

    if engine == VLLM_OMNI:
        config = copy.deepcopy(config)
        config.text_config.num_hidden_layers = TEXT_ENCODER_LAYERS
    with torch.device("meta"):
        model = Qwen3VLModel._from_config(config, dtype=dtype)
    if tp_size > 1:
        TensorParallel(0, tp_size, None, TEXT_ENCODER_TP_PLAN).shard_module(model)
    scratch = _fp8_swap(model, "text_encoder", quant, dtype, stored)
    tensors = _tensor_bytes(model, lambda _k, t, _p: t.dtype)
    if engine == VLLM_OMNI:
        numel, nbytes = tensors[EMBEDDING]
        tensors[EMBEDDING] = (-(-numel // tp_size), -(-nbytes // tp_size))
    return replace(_split("text_encoder", tensors, TEXT_GROUPS), fp8_scratch=scratch)


# ------------------------------------------------------------------------------------------------------------
# Sources: a checkpoint folder's configs, or the released architecture
def text_holders(degrees: ParallelDegrees) -> tuple[int, ...]:
    """Ranks that hold text-encoder weights: the first N under text-encoder TP N > 1, else rank 0 alone."""
    return tuple(range(degrees.text_encoder_tp)) if degrees.text_encoder_tp > 1 else (0,)


def build_inventory(
    source: str | Path,
    degrees: ParallelDegrees | None = None,
    dits: tuple[str, ...] = ("transformer", "transformer_ref"),
    device_type: str = "cuda",
    dtype: torch.dtype | None = None,
    quantization: QuantizationConfig | None = None,
    engine: str = H3SERVE,
    base: Path | None = None,
) -> Inventory:
    """The inventory of `source` ("released", or a checkpoint folder) for one parallel layout.

    `dtype` defaults to the engine's: bf16 on CUDA, fp32 on CPU. Only configs (and safetensors headers) are read.
    With `quantization`, the FP8 components count 1 byte a quantised weight plus its float32 scales; so do the
    linears a checkpoint stores in FP8, whatever the flags. `engine="vllm-omni"`: the video VAE and the text
    encoder as vLLM-Omni holds them (h3serve.offload.measured_engine). `base`: a FastH3 V2 tree's VAE checkpoint.
    """
    check_engine(engine)
    degrees = degrees or ParallelDegrees()
    dtype = dtype or (torch.bfloat16 if device_type == "cuda" else torch.float32)
    configs = released_configs(dits) if source == RELEASED else checkpoint_configs(Path(source), dits, base)
    # One DiT build per distinct config: the two released DiTs share one architecture.
    built: dict[str, ComponentBytes] = {}

    def quant(name: str) -> ComponentQuant | None:
        return quantization.component(name) if quantization is not None else None

    def build_key(name: str) -> tuple:
        return configs.dits[name], quant(name), configs.stored.get(name), configs.gates.get(name)

    for name, cfg in configs.dits.items():
        twin = next((o for o in built if build_key(o) == build_key(name)), None)
        built[name] = (
            replace(built[twin], name=name)
            if twin
            else dit_bytes(name, cfg, dtype, degrees.tensor_parallel, quant(name), configs.stored.get(name),
                           configs.gates.get(name))
        )
    vae, vae_shape = vae_bytes(configs.vae, torch.float32 if engine == VLLM_OMNI else dtype)
    shared = {**built, "vae": vae, "audio_vae": audio_vae_bytes(configs.audio_vae)}
    text = text_encoder_bytes(
        configs.text, dtype, degrees.text_encoder_tp, quant("text_encoder"), configs.stored.get("text_encoder"), engine
    )
    holders = text_holders(degrees)
    ranks = tuple({**shared, "text_encoder": text} if r in holders else dict(shared) for r in range(degrees.world_size))
    t = configs.text.text_config
    return Inventory(
        source=str(source),
        degrees=degrees,
        device_type=device_type,
        dtype=dtype,
        ranks=ranks,
        dits=dict(configs.dits),
        text=TextShape(
            hidden=t.hidden_size,
            layers=t.num_hidden_layers,
            heads=t.num_attention_heads,
            kv_heads=t.num_key_value_heads,
            head_dim=t.head_dim,
            intermediate=t.intermediate_size,
        ),
        vae=vae_shape,
        engine=engine,
    )
