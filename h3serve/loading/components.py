"""Loading an H3 checkpoint inside a rank process: the DiTs, VAEs, text conditioner and processor settings.

Weights are never read whole (h3serve.loading.tensors); a sharded folder (`*.safetensors.index.json`) and a single
file
load the same way; diffusers and native key names both work.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from h3serve.accel.quantize import prepare_fp8, quantizing
from h3serve.adapters.weight_edits import WeightEdits
from h3serve.checkpoint import native_config, native_names
from h3serve.checkpoint.file_reading import file_metadata, safetensors_header, weight_keys
from h3serve.checkpoint.resolver import CheckpointError, CheckpointLayout, read_json, safetensors_files
from h3serve.config.quantization_config import ComponentQuant, QuantizationConfig
from h3serve.loading import dit_keys as native_keys
from h3serve.loading import dit_pieces
from h3serve.loading import fasth3_fusion as fuse_adapter
from h3serve.loading.dit_pieces import BlockPieces
from h3serve.loading.native_vaes import load_native_audio_vae, load_native_video_vae
from h3serve.loading.quantize_on_load import TextQuantizer, load_stored_fp8, text_quantizer
from h3serve.loading.tensors import iter_tensors, materialize, realign
from h3serve.loading.text_encoder_shards import load_parallel_text_conditioner
from h3serve.model.audio_decode import streamline_audio_vae
from h3serve.model.text_encoder import TextConditioner
from h3serve.model.transformer import H3Transformer, H3TransformerConfig, RotaryEmbedding3D

if TYPE_CHECKING:
    from h3serve.parallel.setup import RankParallel
    from h3serve.parallel.tensor_parallel import TensorParallel


def load_transformer(
    folder: str | Path,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    qkv_layout: native_keys.QkvLayout | None = None,
    tp: TensorParallel | None = None,
    quant: ComponentQuant | None = None,
    kernel: str = "weight_only",
    component: str = "transformer",
    adapter: str | None = None,
    pieces: BlockPieces | None = None,
    merged: WeightEdits | None = None,
) -> H3Transformer:
    """Load an H3 DiT from a diffusers-layout or native-layout folder (meta init, tensor-by-tensor).

    The native key names are detected over every shard's header. A native fused QKV's row order is `qkv_layout`,
    else the config's `qkv_layout`, else "interleaved" (the MiniMaxAI shards). With `tp`, the model is this rank's
    tensor-parallel shard and only its slices are read. With `quant` (or FP8 weights in the checkpoint) the selected
    linears load as FP8 (h3serve.accel.quantize), each weight quantised on `device` as it is read. `adapter`: a
    FastH3 file fused into the weights as they are read, in fp32, before the FP8 step (h3serve.loading.fasth3_fusion);
    `merged`: a LoRA adapter's edits fused the same way (`--merge-lora`; checked against the DiT by the catalog).
    `pieces` (DLO all-gather): the streamed blocks are not read; they stay on the meta device, Q/K/V fused, with a
    source for each tensor in `pieces.sources`, from which the offload units read only this rank's piece
    (h3serve.loading.dit_pieces).
    """
    folder = Path(folder)
    config_path = folder / "config.json"
    values, declared = native_config.dit_config(read_json(config_path), str(config_path))
    cfg = H3TransformerConfig.from_dict(values)
    device = torch.device(device)
    files = safetensors_files(folder)
    keys = weight_keys(files)
    with torch.device("meta"):
        model = H3Transformer(cfg)
        gates = [key for key in keys if ".attn.to_gate_compress." in key]
        if gates:  # video sparse attention's learned gates (a FastH3 V2 checkpoint)
            model.add_sparse_gates(bias=any(key.endswith(".bias") for key in gates))
    native = native_names.is_native_key_set(keys)
    layout = resolve_qkv_layout(files, qkv_layout, declared) if native else "interleaved"
    if native:
        check_native_shapes(files, cfg, model.state_dict())
        check_native_rope(files, cfg)
    if adapter is not None and merged is not None:
        raise ValueError("a FastH3 adapter and a merged LoRA cannot both be fused (refused at start-up)")
    fasth3 = merged if adapter is None else fuse_adapter.prepare(adapter, model)  # checked on the whole DiT
    lazy = pieces.lazy if pieces is not None else lambda name: False
    name_of = native_names.native_to_diffusers_name if native else lambda key: key

    def read_now(key: str) -> bool:  # a native `rope.inv_freq` is read only by check_native_rope
        return not lazy(name_of(key)) and not (native and key == "rope.inv_freq")

    if tp is not None:  # tensor parallel (h3serve.parallel): shard-shaped modules, sliced reads
        from h3serve.loading.dit_shards import iter_dit_shards

        tp.shard_module(model)
        tensors = iter_dit_shards(files, cfg, native, layout, tp, read_now)
    else:
        tensors = iter_tensors(files, read_now)
        if native:
            tensors = _converted(tensors, cfg, layout)
    if fasth3 is not None:
        tensors = fuse_adapter.fused(tensors, fasth3, tp, frozenset(filter(lazy, fasth3.edited)))
    # After sharding (FP8 twins of the shard-shaped linears), before offload placement.
    rename = native_names.native_module_names if native else None
    fp8 = prepare_fp8(model, component, quant, files, dtype, kernel, rename)
    if fp8 is not None:
        tensors = quantizing(tensors, fp8, device, tp)
    stored = fp8.stored if fp8 is not None else frozenset()
    keep_fp32 = H3Transformer.keep_in_fp32_modules
    sources = {}
    if pieces is not None:  # the streamed blocks: sources, no reads (h3serve.loading.dit_pieces)
        rules = dit_pieces.LoadRules(cfg, native, layout, tp, dtype, keep_fp32, fp8, fasth3)
        shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
        sources = dit_pieces.block_sources(files, rules, lazy, shapes)
        dit_pieces.place_on_meta(model, sources)
    materialize(model, tensors, dtype, device, keep_fp32, stored, deferred=frozenset(sources))
    if pieces is not None:
        model.fuse_projections()  # on the meta blocks: the fused layers' sources take rows from q, k and v
        dit_pieces.bind_sources(model, sources, lazy, pieces.sources)
    # The RoPE table is a non-persistent buffer: rebuilt off the meta device, never loaded.
    model.rope = RotaryEmbedding3D(cfg.rope_freq_dim, cfg.rope_theta).to(device)
    return model.eval()


def resolve_qkv_layout(
    files: list[Path], flag: native_keys.QkvLayout | None, declared: str | None
) -> native_keys.QkvLayout:
    """The fused QKV row order: the flag, else the config's `qkv_layout`, else the default; every file's
    `__metadata__["qkv_layout"]` must agree (a stacked export loaded as interleaved would load silently wrong)."""
    if flag is not None and flag not in native_config.QKV_LAYOUTS:
        raise CheckpointError(f"qkv_layout must be one of {', '.join(native_config.QKV_LAYOUTS)}, got {flag!r}")
    if flag is not None and declared is not None and flag != declared:
        raise CheckpointError(f"--qkv-layout {flag} contradicts the checkpoint config's qkv_layout {declared!r}")
    layout = flag or declared or native_config.DEFAULT_QKV_LAYOUT
    for file in files:
        stated = file_metadata(file).get("qkv_layout")
        if stated is not None and stated != layout:
            source = "--qkv-layout" if flag else "config.json" if declared else "the default"
            raise CheckpointError(
                f"{file}: its metadata says qkv_layout={stated!r} but {source} gives {layout!r}; "
                "pass the layout the file was written with"
            )
    return layout  # type: ignore[return-value]


def check_native_shapes(files: list[Path], cfg: H3TransformerConfig, expected: dict[str, torch.Tensor]) -> None:
    """Every native tensor's header shape against the model's, by its checkpoint key (no tensor is read)."""
    for file in files:
        for key, info in safetensors_header(file).items():
            if key == "__metadata__":
                continue
            name = native_names.native_to_diffusers_name(key)
            if name.endswith(".weight_scale"):  # an FP8 scale: one, or one per output row of its weight
                _check_scale(file, key, tuple(info["shape"]), _native_rows(name, cfg, expected))
                continue
            if name == "rope.inv_freq":
                want: tuple[int, ...] = (cfg.rope_freq_dim,)
            elif name.endswith(".attn.qkv_proj.weight"):
                want = (3 * cfg.inner_dim, cfg.hidden_size)
            elif name in expected:
                want = tuple(expected[name].shape)
            else:
                raise CheckpointError(f"{file.name}: unexpected weight '{key}' for {H3Transformer.__name__}")
            if tuple(info["shape"]) != want:
                raise CheckpointError(
                    f"{file.name}: checkpoint key '{key}' has shape {tuple(info['shape'])}, expected {want}"
                )


def check_native_rope(files: list[Path], cfg: H3TransformerConfig) -> None:
    """A native checkpoint's `rope.inv_freq` (never loaded: the table is rebuilt from the config) must be the table
    of the config's `rope_theta`, so that a config without it (the default 10000) or with another one cannot silently
    rotate every token otherwise than the weights were trained with. To 1 % (a bf16 copy passes)."""
    stored = dict(iter_tensors(files, lambda key: key == "rope.inv_freq")).get("rope.inv_freq")
    if stored is None:
        return
    stored, want = stored.float().flatten(), RotaryEmbedding3D(cfg.rope_freq_dim, cfg.rope_theta).inv_freq
    if stored.shape == want.shape and torch.allclose(stored, want, rtol=1e-2):
        return
    theta = float(stored[1]) ** (-cfg.rope_freq_dim) if len(stored) > 1 and float(stored[1]) > 0 else float("nan")
    raise CheckpointError(
        f"checkpoint key 'rope.inv_freq' is the RoPE table of rope_theta ≈ {theta:.4g}, but config.json gives "
        f"rope_theta {cfg.rope_theta:g}: set rope_theta in the config to the trained value"
    )


def _native_rows(scale_name: str, cfg: H3TransformerConfig, expected: dict[str, torch.Tensor]) -> int:
    weight = scale_name[: -len("_scale")]
    if weight.endswith(".attn.qkv_proj.weight"):
        return 3 * cfg.inner_dim
    if weight not in expected:
        raise CheckpointError(f"a weight_scale for '{weight}', which {H3Transformer.__name__} does not have")
    return expected[weight].shape[0]


def _check_scale(file: Path, key: str, shape: tuple[int, ...], rows: int) -> None:
    if shape not in ((), (1,), (1, 1), (rows,), (rows, 1)):
        raise CheckpointError(
            f"{file.name}: FP8 scale '{key}' has shape {shape}, expected one value or one per output row ({rows})"
        )


def _converted(
    tensors: Iterator[tuple[str, torch.Tensor]], cfg: H3TransformerConfig, qkv_layout: native_keys.QkvLayout
) -> Iterator[tuple[str, torch.Tensor]]:
    for key, tensor in tensors:
        name = native_names.native_to_diffusers_name(key)
        yield from native_keys.split_native_tensor(
            name, tensor, cfg.num_attention_heads, cfg.attention_head_dim, qkv_layout
        )


# ------------------------------------------------------------------------------------------------------------
# Components
# ------------------------------------------------------------------------------------------------------------


def load_text_conditioner(
    folder: Path,
    tokenizer_folder: Path,
    dtype: torch.dtype,
    device: torch.device,
    quantize: TextQuantizer | None = None,
    kernel: str = "weight_only",
):
    """Qwen3-VL truncated to the layers the conditioning reads (layer 50 + 1), plus its tokenizer; `quantize`
    (FP8) runs on the loaded encoder before it moves to `device`. Linears the checkpoint stores in FP8 (F8_E4M3 +
    `weight_scale`) hold the stored bytes and scales, with or without `quantize`, on the `kernel` path.

    hidden_states[50] is the 50th layer's output before the final norm. Keeping layer 51 keeps that
    entry un-normed (transformers replaces the *last* entry with the normed state); later layers are
    never loaded, which saves their memory and load time on the real 64-layer encoder.
    """
    from transformers import AutoConfig, AutoTokenizer, Qwen3VLForConditionalGeneration
    from transformers.utils import logging as hf_logging

    from h3serve.checkpoint.text_encoder_names import checkpoint_module_names
    from h3serve.rules import limits

    config = AutoConfig.from_pretrained(folder)
    total = config.text_config.num_hidden_layers
    if total <= limits.TEXT_ENCODER_LAYER:
        raise CheckpointError(
            f"{folder}: the text encoder has {total} layers; MiniMax-H3 needs more than {limits.TEXT_ENCODER_LAYER}"
        )
    config.text_config.num_hidden_layers = limits.TEXT_ENCODER_LAYER + 1
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # the skipped layers' weights are "unused" on purpose
    try:
        encoder = Qwen3VLForConditionalGeneration.from_pretrained(folder, config=config, dtype=dtype)
    finally:
        hf_logging.set_verbosity(verbosity)
    model = encoder.model
    del encoder  # the LM head is never used
    stored_names = checkpoint_module_names(config.text_config.num_hidden_layers)
    load_stored_fp8(model, safetensors_files(folder), stored_names, dtype, kernel)
    if quantize is not None:
        quantize(model, device, None)
    model = model.to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_folder)
    return TextConditioner(model, tokenizer, limits.TEXT_ENCODER_LAYER)


def read_vision_config(folder: str | Path):
    """The Qwen3-VL image/video preprocessing settings of a `processor/` folder, with transformers' priority:
    the nested `processor_config.json`, else `preprocessor_config.json` for images and
    `video_preprocessor_config.json` (else `preprocessor_config.json`) for videos."""
    from h3serve.model.vision_inputs import VisionProcessorConfig

    folder = Path(folder)
    if (folder / "processor").is_dir():
        folder = folder / "processor"

    def read(name: str) -> dict | None:
        return read_json(folder / name) if (folder / name).is_file() else None

    nested = read("processor_config.json") or {}
    flat_image = read("preprocessor_config.json")
    image = nested.get("image_processor", flat_image)
    video = nested.get("video_processor") or read("video_preprocessor_config.json") or flat_image
    if image is None or video is None:
        raise CheckpointError(f"{folder}: no Qwen image/video processor config")
    return VisionProcessorConfig.from_dict({"image_processor": image, "video_processor": video})


def load_components(
    layout: CheckpointLayout,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    dits: tuple[str, ...] = ("transformer", "transformer_ref"),
    parallel: RankParallel | None = None,
    on_host: frozenset[str] = frozenset(),
    quantization: QuantizationConfig | None = None,
    kernel: str = "weight_only",
    dit_adapter: str | None = None,
    qkv_layout: native_keys.QkvLayout | None = None,
    pieces: BlockPieces | None = None,
    merged_lora: WeightEdits | None = None,
    lean_audio_decode: bool = True,
):
    """Load the requested DiTs that the checkpoint has, the VAEs and the text conditioner, one at a time, in the
    steps below (each says what it reads).

    `transformer` serves T2VA and FL2VA, `transformer_ref` serves Ref2VA; the encoder and VAEs are shared.
    Components named in `on_host` load into host memory (h3serve.offload moves them to `device` when used).
    `quantization` names the components whose linears load as FP8, on the `kernel` path. `dit_adapter`: a FastH3
    file fused into the T2VA DiT (`transformer`) at load; `merged_lora`: a LoRA adapter fused into every loaded DiT
    (`--merge-lora`: the server serves that adapter only). `pieces`: the DiTs' streamed blocks are left to the offload
    units, which read only this rank's piece of them (DLO all-gather, `load_transformer`). `lean_audio_decode`: the
    audio VAE's weight norms folded and its decode streamlined (h3serve.model.audio_decode; the same bits); the demo
    trainer, which trains the weight norms, loads it as stored.
    """
    from h3serve.model.pipeline_types import H3Components

    device = torch.device(device)

    def where(name: str) -> torch.device:
        return torch.device("cpu") if name in on_host else device

    dit_models = _load_dits(layout, dits, dtype, where, parallel, quantization, kernel, dit_adapter, qkv_layout,
                            pieces, merged_lora)
    return H3Components(
        transformer=dit_models.get("transformer"),
        transformer_ref=dit_models.get("transformer_ref"),
        vae=_load_video_vae(layout, dtype, where("vae")),
        audio_vae=_load_audio_vae(layout, where("audio_vae"), lean_audio_decode),
        text=_load_text(layout, dtype, device, where("text_encoder"), parallel, quantization, kernel),
        vision_config=read_vision_config(layout.component("processor")),
    )


def _load_dits(
    layout: CheckpointLayout,
    dits: tuple[str, ...],
    dtype: torch.dtype,
    where: Callable[[str], torch.device],
    parallel: RankParallel | None,
    quantization: QuantizationConfig | None,
    kernel: str,
    dit_adapter: str | None,
    qkv_layout: native_keys.QkvLayout | None,
    pieces: BlockPieces | None,
    merged_lora: WeightEdits | None,
) -> dict[str, nn.Module]:
    """Step 1, the DiTs the checkpoint has of `dits`: each read tensor by tensor (this rank's TP shard, FP8 where
    asked, a FastH3 adapter or a merged LoRA fused in as read)."""
    present = [name for name in dits if layout.has(name)]
    if not present:
        raise CheckpointError(f"{layout.root}: none of the DiTs {', '.join(dits)} is in this checkpoint")
    tp = parallel.dit_tp if parallel is not None else None
    return {
        name: load_transformer(
            layout.component(name),
            dtype,
            where(name),
            qkv_layout=qkv_layout,
            tp=tp,
            quant=quantization.component(name) if quantization is not None else None,
            kernel=kernel,
            component=name,
            adapter=dit_adapter if name == "transformer" else None,
            pieces=pieces,
            merged=merged_lora,
        )
        for name in present
    }


def _load_video_vae(layout: CheckpointLayout, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """Step 2, the video VAE: diffusers' folder, or the MiniMaxAI video_vae/ (original names, fused tensors),
    converted as read."""
    from diffusers import AutoencoderKLMiniMaxH3

    if layout.is_native("vae"):
        return load_native_video_vae(layout.component("vae"), dtype, device)
    vae = AutoencoderKLMiniMaxH3.from_pretrained(layout.component("vae"), torch_dtype=dtype)
    return realign(vae.to(device)).eval()  # diffusers keeps views of the file: see h3serve.loading.tensors


def _load_audio_vae(layout: CheckpointLayout, device: torch.device, lean: bool) -> nn.Module:
    """Step 3, the audio VAE, fp32 by policy (every module is in its keep-in-fp32 list); `lean`: streamlined for
    decoding (the same bits with less work, h3serve.model.audio_decode)."""
    from diffusers import AutoencoderKLMiniMaxH3Audio

    if layout.is_native("audio_vae"):
        audio_vae = load_native_audio_vae(layout.component("audio_vae"), device)
    else:
        audio_vae = AutoencoderKLMiniMaxH3Audio.from_pretrained(layout.component("audio_vae")).to(device)
        realign(audio_vae).eval()
    return streamline_audio_vae(audio_vae) if lean else audio_vae


def _load_text(
    layout: CheckpointLayout,
    dtype: torch.dtype,
    device: torch.device,
    load_device: torch.device,
    parallel: RankParallel | None,
    quantization: QuantizationConfig | None,
    kernel: str,
) -> TextConditioner:
    """Step 4, the text conditioner: Qwen3-VL truncated to the layer the DiT reads, whole, or sharded over the
    first ranks under text-encoder TP (not loaded on the others); FP8 where asked."""
    text_folders = (layout.component("text_encoder"), layout.component("tokenizer"))
    quantize_text = text_quantizer(quantization, dtype, kernel)
    if parallel is None:
        return load_text_conditioner(*text_folders, dtype, load_device, quantize_text, kernel)
    return load_parallel_text_conditioner(
        parallel,
        *text_folders,
        dtype,
        device,
        load_whole=partial(load_text_conditioner, quantize=quantize_text, kernel=kernel),
        load_device=load_device,
        quantize=quantize_text,
        kernel=kernel,
    )
