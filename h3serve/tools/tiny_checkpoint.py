"""Deterministic, random-weight MiniMax-H3 checkpoints in the diffusers *modular* layout.

The checkpoint has every component the diffusers ``MiniMaxH3ModularPipeline`` expects, with tiny configs (spec §10),
so that every workflow runs in seconds on a CPU. Same preset and seed give byte-identical files.

The ``modular_model_index.json`` stores ``pretrained_model_name_or_path: null`` with ``subfolder = <component>``:
diffusers resolves a component to the directory passed to ``ModularPipeline.from_pretrained`` whenever that
directory holds the component's files, so the checkpoint loads from wherever it is moved to.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import math
import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch import Generator, nn
    from transformers import Qwen2TokenizerFast, Qwen3VLProcessor

# Bump when the generated files change, so that cached checkpoints are rebuilt.
FORMAT_VERSION = 2
# Written last into a checkpoint: marks it complete and records what it was built from.
MARKER_FILE = "tiny_checkpoint.json"

_EOS_TOKEN = "<|endoftext|>"
_VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
_TEXT_LAYERS = 51  # the pipeline reads hidden_states[50] and needs more than 50 decoder layers
_TEXT_HIDDEN = 32
_PROCESSOR_SIZE = {"shortest_edge": 1024, "longest_edge": 4096}
_PROCESSOR_MEAN_STD = (0.5, 0.5, 0.5)
_AUDIO_OUTPUT_GAIN = 0.02


@dataclass(frozen=True)
class Preset:
    """Sizes of one checkpoint preset: the DiT config and the pipeline's canvas config values."""

    transformer: Mapping[str, Any]
    canvas_short_edge: int
    canvas_max_pixels: int
    reference_image_short_edge: int


# 4 heads: TP2 x Ulysses 2 fits; 6 blocks: resident-layer counts 0, 1, all-but-2 and all are distinct.
_TINY_TRANSFORMER: Mapping[str, Any] = MappingProxyType(
    {
        "num_attention_heads": 4,
        "attention_head_dim": 32,
        "hidden_size": 48,
        "num_layers": 6,
        "num_refiner_layers": 1,
        "ffn_dim": 64,
        "in_channels": 24,
        "audio_in_channels": 32,
        "text_dim": _TEXT_HIDDEN,
        "freq_dim": 32,
        "time_embed_hidden_dim": 48,
        "time_embed_dim": 24,
        "rope_freq_dim": 4,
    }
)

_CPU_BENCH_TRANSFORMER: Mapping[str, Any] = MappingProxyType(
    {
        **_TINY_TRANSFORMER,
        "num_attention_heads": 8,
        "attention_head_dim": 64,
        "hidden_size": 512,
        "num_layers": 4,
        "ffn_dim": 1408,
        "rope_freq_dim": 8,
    }
)

PRESETS: dict[str, Preset] = {
    "tiny": Preset(_TINY_TRANSFORMER, canvas_short_edge=64, canvas_max_pixels=64 * 128, reference_image_short_edge=64),
    "cpu-bench": Preset(
        _CPU_BENCH_TRANSFORMER, canvas_short_edge=256, canvas_max_pixels=448 * 256, reference_image_short_edge=256
    ),
}

_VAE_CONFIG: Mapping[str, Any] = MappingProxyType(
    {
        "latent_channels": 24,
        "block_out_channels": (8,) * 6,
        "layers_per_block": 1,
        "norm_num_groups": 4,
        "decoder_num_layers": 1,
        "decoder_num_attention_heads": 2,
        "decoder_attention_head_dim": 16,
        "decoder_ffn_mult": 2,
    }
)

_AUDIO_VAE_CONFIG: Mapping[str, Any] = MappingProxyType(
    {
        "encoder_dim": 4,
        "encoder_rates": (2, 4, 4, 5, 5),
        "latent_dim": 64,
        "latent_channels": 32,
        "num_attention_heads": 2,
        "decoder_dim": 128,
        "resblock_kernel_sizes": (3,),
        "resblock_dilation_sizes": ((1, 3),),
    }
)


# --------------------------------------------------------------------------------------------------------------------
# Public API


def build_tiny_checkpoint(out_dir: str | Path, seed: int = 0, preset: str = "tiny") -> Path:
    """Write a complete random-weight checkpoint into ``out_dir`` (absent or empty) and return its path."""
    spec = _get_preset(preset)
    seed = _check_seed(seed)
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"refusing to build a checkpoint into non-empty directory {out}")
    out.mkdir(parents=True, exist_ok=True)

    components = _build_components(spec, seed)
    with _quiet_progress_bars():
        for name in sorted(components):
            components[name].save_pretrained(str(out / name))
    _write_index(out, components, spec)
    _make_readable(out)
    _write_json(out / MARKER_FILE, _marker(preset, seed))
    return out


def cache_root() -> Path:
    """The h3serve cache: ``$H3SERVE_CACHE_DIR``, else ``$XDG_CACHE_HOME/h3serve``, else ``~/.cache/h3serve``."""
    if explicit := os.environ.get("H3SERVE_CACHE_DIR"):
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "h3serve"


def default_checkpoint_dir(preset: str = "tiny", seed: int = 0) -> Path:
    """Where :func:`ensure_tiny_checkpoint` keeps the checkpoint of ``preset`` and ``seed``."""
    _get_preset(preset)
    return cache_root() / "checkpoints" / f"{preset}-seed{_check_seed(seed)}"


def is_complete_checkpoint(path: str | Path, preset: str = "tiny", seed: int = 0) -> bool:
    """Whether ``path`` holds a finished checkpoint of this preset, seed and format version."""
    try:
        marker = json.loads((Path(path) / MARKER_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return marker == _marker(preset, seed)


def ensure_tiny_checkpoint(preset: str = "tiny", seed: int = 0) -> Path:
    """Return the cached checkpoint of ``preset``/``seed``, building it first if needed.

    The build goes into a temporary directory beside the target and is renamed into place, under an exclusive
    ``fcntl`` lock, so concurrent callers build it once and never see a partial checkpoint.
    """
    target = default_checkpoint_dir(preset, seed)
    if is_complete_checkpoint(target, preset, seed):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(target.parent / f".{target.name}.lock"):
        if is_complete_checkpoint(target, preset, seed):
            return target
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
        try:
            build_tiny_checkpoint(staging, seed=seed, preset=preset)
            _replace_dir(staging, target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return target


def load_processor(checkpoint_dir: str | Path) -> Qwen3VLProcessor:
    """Load ``<checkpoint_dir>/processor`` without torchvision.

    ``Qwen3VLProcessor.from_pretrained`` needs torchvision to resolve its video processor class. The parts are loaded
    one by one instead (PIL image processor, tokenizer, video processor config) and assembled in memory.
    """
    from transformers import Qwen2TokenizerFast, Qwen2VLImageProcessorPil
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    folder = str(Path(checkpoint_dir) / "processor")
    image_processor = Qwen2VLImageProcessorPil.from_pretrained(folder)
    video_processor = Qwen3VLVideoProcessor.from_pretrained(folder)
    tokenizer = Qwen2TokenizerFast.from_pretrained(folder)
    return _make_processor(image_processor, tokenizer, video_processor)


# --------------------------------------------------------------------------------------------------------------------
# Helpers: presets, seeds, files


def _get_preset(name: str) -> Preset:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}") from None


def _check_seed(seed: int) -> int:
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be a non-negative int, got {seed!r}")
    return seed


def _marker(preset: str, seed: int) -> dict[str, Any]:
    return {"format_version": FORMAT_VERSION, "preset": preset, "seed": seed}


def _write_json(path: Path, data: Mapping[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    with open(path, "a", encoding="utf-8") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


@contextlib.contextmanager
def _quiet_progress_bars() -> Iterator[None]:
    """Hide transformers' "Writing model shards" progress bars."""
    from transformers.utils import logging as hf_logging

    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            hf_logging.enable_progress_bar()


def _make_readable(root: Path) -> None:
    """Give every file mode 0644 and every folder 0755 (safetensors writes its files 0600)."""
    for folder, _, files in os.walk(root):
        os.chmod(folder, 0o755)
        for name in files:
            os.chmod(os.path.join(folder, name), 0o644)


def _replace_dir(source: Path, target: Path) -> None:
    """Move ``source`` to ``target``; a stale ``target`` (incomplete or outdated) is moved aside first."""
    if target.exists():
        stale = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".stale", dir=target.parent))
        os.rename(target, stale / target.name)
        os.rename(source, target)
        shutil.rmtree(stale, ignore_errors=True)
    else:
        os.rename(source, target)


def _derive_seed(seed: int, name: str) -> int:
    """A per-component seed, so that each component's weights do not depend on the others."""
    digest = hashlib.sha256(f"h3serve-tiny-checkpoint/{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def _generator(seed: int, name: str) -> Generator:
    import torch

    return torch.Generator(device="cpu").manual_seed(_derive_seed(seed, name))


# --------------------------------------------------------------------------------------------------------------------
# Helpers: weights


def _construct(factory: Any, *args: Any, **kwargs: Any) -> Any:
    """Call a module constructor without touching the caller's global RNG (its random init is overwritten)."""
    import torch

    with torch.random.fork_rng(devices=[]):
        return factory(*args, **kwargs)


def _randomize_(module: nn.Module, generator: Generator) -> None:
    """Overwrite every parameter of ``module`` in place with draws from ``generator``.

    Parameters the constructor set to a constant (norm weights, zero biases, gates, Snake alphas) become that
    constant plus N(0, 0.1²) noise; other matrices get N(0, 1/fan_in) and other vectors N(0, 0.02²). A weight-norm
    gain ``weight_g`` is the norm of its ``weight_v`` times a factor in [0.5, 1.5]. Buffers (filters, RoPE tables)
    are kept. Values are computed in float64 and rounded once, so the bits do not depend on the CPU's SIMD paths.
    """
    import torch

    with torch.no_grad():
        gains = []
        for name, param in module.named_parameters():
            if name.endswith("weight_g"):
                gains.append((name, param))
            else:
                param.copy_(_draw_like(param, generator))
        for name, gain in gains:
            direction = module.get_parameter(name.removesuffix("g") + "v").double()
            norm = direction.norm(dim=tuple(range(1, direction.dim())), keepdim=True)
            gain.copy_(norm * (0.5 + torch.rand(gain.shape, generator=generator, dtype=torch.float64)))


def _draw_like(param: nn.Parameter, generator: Generator) -> torch.Tensor:
    import torch

    noise = torch.randn(param.shape, generator=generator, dtype=torch.float64)
    flat = param.detach().reshape(-1)
    if flat.numel() > 1 and bool((flat == flat[0]).all()):
        return float(flat[0]) + 0.1 * noise
    if param.dim() >= 2:
        return noise / math.sqrt(param.numel() // param.shape[0])
    return 0.02 * noise


def _latent_stats(generator: Generator, channels: int) -> tuple[list[float], list[float]]:
    """Random per-channel ``latents_mean`` / ``latents_std``, rounded to keep the JSON short."""
    import torch

    mean = 0.5 * torch.randn(channels, generator=generator, dtype=torch.float64)
    std = 0.5 + torch.rand(channels, generator=generator, dtype=torch.float64)
    return [round(v, 4) for v in mean.tolist()], [round(v, 4) for v in std.tolist()]


# --------------------------------------------------------------------------------------------------------------------
# Helpers: components


def _build_components(spec: Preset, seed: int) -> dict[str, Any]:
    from diffusers import MiniMaxH3Scheduler

    tokenizer = _build_tokenizer()
    return {
        "transformer": _build_transformer(spec, _generator(seed, "transformer")),
        "transformer_ref": _build_transformer(spec, _generator(seed, "transformer_ref")),
        "vae": _build_vae(_generator(seed, "vae")),
        "audio_vae": _build_audio_vae(_generator(seed, "audio_vae")),
        "text_encoder": _build_text_encoder(tokenizer, _generator(seed, "text_encoder")),
        "tokenizer": tokenizer,
        "processor": _build_processor(tokenizer),
        "scheduler": MiniMaxH3Scheduler(shift=12.0),
        "audio_scheduler": MiniMaxH3Scheduler(shift=3.0),
    }


def _build_transformer(spec: Preset, generator: Generator) -> nn.Module:
    from diffusers import MiniMaxH3Transformer3DModel

    model = _construct(MiniMaxH3Transformer3DModel, **spec.transformer)
    _randomize_(model, generator)
    return model.eval()


def _build_vae(generator: Generator) -> nn.Module:
    from diffusers import AutoencoderKLMiniMaxH3

    mean, std = _latent_stats(generator, _VAE_CONFIG["latent_channels"])
    model = _construct(AutoencoderKLMiniMaxH3, **_VAE_CONFIG, latents_mean=mean, latents_std=std)
    _randomize_(model, generator)
    return model.eval()


def _build_audio_vae(generator: Generator) -> nn.Module:
    import warnings

    import torch
    from diffusers import AutoencoderKLMiniMaxH3Audio

    mean, std = _latent_stats(generator, _AUDIO_VAE_CONFIG["latent_channels"])
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*weight_norm.*is deprecated", category=FutureWarning)
        model = _construct(AutoencoderKLMiniMaxH3Audio, **_AUDIO_VAE_CONFIG, latents_mean=mean, latents_std=std)
    _randomize_(model, generator)
    # The random BigVGAN stack amplifies: its output has std ~10 before the [-1, 1] clamp. Shrink the last conv so
    # that decoded audio stays mostly unclamped (std ~0.1-0.4) and parity tests compare real values.
    with torch.no_grad():
        model.decoder.conv_post.weight_g.mul_(_AUDIO_OUTPUT_GAIN)
    return model.eval()


def _byte_symbols() -> list[str]:
    """The 256 byte-level BPE symbols (GPT-2 convention): printable bytes map to themselves, the rest above 255."""
    printable = set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAC + 1)) | set(range(0xAE, 0xFF + 1))
    symbols, shifted = [], 0
    for byte in range(256):
        if byte in printable:
            symbols.append(chr(byte))
        else:
            symbols.append(chr(256 + shifted))
            shifted += 1
    return symbols


def _build_tokenizer() -> Qwen2TokenizerFast:
    """A merge-free byte-level Qwen2 tokenizer: one token per UTF-8 byte, plus the Qwen-VL special tokens."""
    from transformers import Qwen2TokenizerFast

    vocab = {symbol: index for index, symbol in enumerate(_byte_symbols())}
    vocab[_EOS_TOKEN] = len(vocab)
    return Qwen2TokenizerFast(vocab=vocab, merges=[], additional_special_tokens=list(_VISION_TOKENS))


def _build_text_encoder(tokenizer: Qwen2TokenizerFast, generator: Generator) -> nn.Module:
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    start_id, end_id, image_id, video_id = tokenizer.convert_tokens_to_ids(list(_VISION_TOKENS))
    text_config = {
        "vocab_size": len(tokenizer),
        "hidden_size": _TEXT_HIDDEN,
        "intermediate_size": 64,
        "num_hidden_layers": _TEXT_LAYERS,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,  # text-encoder TP2 splits both the query and the KV heads
        "head_dim": 16,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 5_000_000.0,
            "mrope_section": [4, 2, 2],
            "mrope_interleaved": True,
        },
    }
    vision_config = {
        "depth": 2,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 2,
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "out_hidden_size": _TEXT_HIDDEN,
        "num_position_embeddings": 256,
        "deepstack_visual_indexes": [0],
    }
    config = Qwen3VLConfig(
        text_config=text_config,
        vision_config=vision_config,
        vision_start_token_id=start_id,
        vision_end_token_id=end_id,
        image_token_id=image_id,
        video_token_id=video_id,
        tie_word_embeddings=False,
    )
    model = _construct(Qwen3VLForConditionalGeneration, config)
    _randomize_(model, generator)
    return model.eval()


def _build_processor(tokenizer: Qwen2TokenizerFast) -> Qwen3VLProcessor:
    from transformers import Qwen2VLImageProcessorPil
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    shared = {
        "patch_size": 16,
        "merge_size": 2,
        "temporal_patch_size": 2,
        "image_mean": list(_PROCESSOR_MEAN_STD),
        "image_std": list(_PROCESSOR_MEAN_STD),
    }
    image_processor = Qwen2VLImageProcessorPil(size=dict(_PROCESSOR_SIZE), **shared)
    video_processor = Qwen3VLVideoProcessor(
        size={"shortest_edge": 4 * 1024, "longest_edge": 64 * 1024}, max_video_tokens=16, **shared
    )
    return _make_processor(image_processor, tokenizer, video_processor)


def _skip_video_processor_class_check() -> contextlib.AbstractContextManager[Any]:
    """Let ``Qwen3VLProcessor`` accept a video processor while torchvision (and so its class registry) is missing."""
    from unittest import mock

    from transformers import Qwen3VLProcessor

    base_check = Qwen3VLProcessor.check_argument_for_proper_class

    def check(self: Any, argument_name: str, argument: Any) -> Any:
        if argument_name == "video_processor":
            return type(argument)
        return base_check(self, argument_name, argument)

    return mock.patch.object(Qwen3VLProcessor, "check_argument_for_proper_class", check)


def _make_processor(image_processor: Any, tokenizer: Any, video_processor: Any) -> Qwen3VLProcessor:
    from transformers import Qwen3VLProcessor

    with _skip_video_processor_class_check():
        return Qwen3VLProcessor(image_processor=image_processor, tokenizer=tokenizer, video_processor=video_processor)


def _write_index(out: Path, components: Mapping[str, Any], spec: Preset) -> None:
    """Write ``modular_model_index.json``; components resolve to ``<checkpoint>/<name>`` wherever it is moved."""
    from diffusers import MiniMaxH3Blocks
    from diffusers.pipelines.pipeline_loading_utils import _fetch_class_library_tuple

    pipe = MiniMaxH3Blocks().init_pipeline()
    for name in sorted(components):
        library, class_name = _fetch_class_library_tuple(components[name])
        loading = {
            "pretrained_model_name_or_path": None,
            "subfolder": name,
            "variant": None,
            "revision": None,
            "type_hint": [library, class_name],
        }
        pipe.register_to_config(**{name: [library, class_name, loading]})
    pipe.register_to_config(
        canvas_short_edge=spec.canvas_short_edge,
        canvas_max_pixels=spec.canvas_max_pixels,
        reference_image_short_edge=spec.reference_image_short_edge,
    )
    pipe.save_config(str(out))
