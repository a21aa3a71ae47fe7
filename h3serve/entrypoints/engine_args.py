"""Engine flags shared by `h3serve generate` and `h3serve serve`, including every flag of vLLM-Omni's H3 launch
recipes (so a recipe runs with `h3serve serve` in place of `vllm serve`).

`add_engine_args(parser)` declares them; `engine_config_from_args(args)` turns them into a validated, frozen
`EngineConfig`. A recipe flag h3serve cannot honour on this hardware or build is refused with a message that
names the fix; one it honours differently (or that has nothing to do here) is applied with a one-line notice
on stderr. None is silently ignored.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from h3serve.adapters.catalog import parse_lora_paths
from h3serve.adapters.fasth3 import is_fasth3_path
from h3serve.config.engine_config import (
    DEFAULT_ADALN_MEMO_BYTES,
    DEFAULT_PROMPT_CACHE_BYTES,
    EngineConfig,
    warmup_shapes,
)
from h3serve.config.offload_config import (
    OffloadConfig,
    OffloadError,
    OffloadFlags,
    offload_config_from_flags,
    parse_bytes,
    parse_denoise_chunk_rows,
)
from h3serve.config.quantization_config import QuantizationError, parse_quantization
from h3serve.config_checks import check_config, notices
from h3serve.errors import ConfigError
from h3serve.rules.names import CACHE_BACKENDS as SERVED_CACHE_BACKENDS
from h3serve.rules.names import TASK_TYPE_ALIASES

# vLLM-Omni's backend names. The dense exact ones are h3serve.accel.attention's registry (which checks that the
# chosen one can run here); the approximate or sparse ones would change the math.
DENSE_ATTENTION = (
    "TORCH_SDPA",
    "FLASH_ATTN",
    "CUDNN_ATTN",
    "FLASHINFER_ATTN",
    "FLASH_ATTN_HUB",
    "FLASH_ATTN_3_HUB",
    "TRTLLM_ATTN",
)
APPROXIMATE_ATTENTION = ("SAGE_ATTN", "SAGE_ATTN_3", "RAINFUSION_ATTN")
SPARSE_ATTENTION = ("FASTVIDEO_VSA",)  # video sparse attention (h3serve.accel.video_sparse): FastH3 V2 runs on it
CACHE_BACKENDS = ("none", "cache_dit", "tea_cache", "mag_cache", "sea_cache", "step_cache")
COMPILE_GRANULARITIES = ("regional", "full")
ULYSSES_MODES = ("strict", "advanced_uaa")


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Declare the engine flags (device, parallel layout, vLLM-Omni recipe compatibility) on `parser`."""
    _add_device_args(parser.add_argument_group("engine"))
    _add_parallel_args(parser.add_argument_group("parallelism (one rank process per GPU; gloo on CPU, NCCL on CUDA)"))
    recipe = parser.add_argument_group("vLLM-Omni recipe compatibility")
    _add_kernel_args(recipe)
    _add_weight_args(recipe)


def _add_device_args(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    g.add_argument("--dtype", default="auto", help="auto (bf16 on GPU, fp32 on CPU) | float32 | bfloat16 | float16")
    g.add_argument("--threads", type=int, default=0, help="CPU threads per rank (0: torch default)")
    g.add_argument("--task-type", default="auto", help="DiTs to load: auto | combined (both) | t2va | fl2va | ref2va")
    g.add_argument("--qkv-layout", default=None,
                   help="row order of a native DiT's fused QKV: interleaved (per head; the MiniMaxAI shards, the "
                   "default) | stacked ([q; k; v], single-file exports); default: the checkpoint config's qkv_layout")
    g.add_argument(
        "--adaln-memo",
        metavar="SIZE|off",
        default=None,
        help="AdaLN modulations computed once per request and kept for later requests in a host store of SIZE "
        f"(default {DEFAULT_ADALN_MEMO_BYTES // 2**30}GiB; exact); off: each forward computes them",
    )
    g.add_argument(
        "--prompt-cache",
        metavar="SIZE|off",
        default=None,
        help="text states of recent prompts kept in host memory, up to SIZE (default "
        f"{DEFAULT_PROMPT_CACHE_BYTES // 2**20}MiB): a repeated prompt skips the text encoder (same bytes); off: "
        "every request encodes its prompt",
    )
    g.add_argument(
        "--adaln-cache-dir",
        metavar="DIR",
        help="sidecar files of the default schedules' AdaLN modulations, written once, read at later start-ups",
    )


def _add_parallel_args(p: argparse._ArgumentGroup) -> None:
    p.add_argument("--num-gpus", type=int, default=0,
                   help="ranks in all (default: tensor-parallel · ulysses · ring · data-parallel); more than "
                        "tensor-parallel · ulysses · ring makes the remainder data-parallel replicas")
    p.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                   help="engine replicas, each its own rank group (GPUs / --threads share) running its own job")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, help="DiT tensor parallel (divides 56 heads)")
    p.add_argument(
        "--usp",
        "--ulysses-degree",
        dest="ulysses_degree",
        type=int,
        default=1,
        help="Ulysses sequence parallel (divides heads / TP)",
    )
    p.add_argument("--ring", "--ring-degree", dest="ring_degree", type=int, default=1, help="Ring sequence parallel")
    p.add_argument("--text-encoder-tp-size", type=int, default=1, help="Qwen3-VL tensor parallel on the first N ranks")
    p.add_argument("--vae-patch-parallel-size", type=int, default=1, help="VAE decode tiles over 1 or all ranks")
    p.add_argument("--vae-parallel-mode", default="tile", help="tile (the only mode of H3's VAE)")
    p.add_argument("--vae-use-tiling", action="store_true", help="tiled VAE decode (always on for H3)")
    p.add_argument("--cfg-parallel-size", type=int, default=1, help="must be 1: H3 is CFG-distilled")
    p.add_argument(
        "--collective-timeout",
        type=float,
        metavar="SECONDS",
        help="how long a rank waits in one collective before the request fails (default: torch's, 30 min on CPU, "
        "10 min on NCCL); across nodes, how long a node that stops answering goes unnoticed (a dead process is "
        "noticed at once). Keep it above the slowest stage a rank waits through (loading, text encoding, decode)",
    )
    p.add_argument(
        "--decode-mode",
        default="stream",
        help="stream (default): VAE clips go into the MP4 as they are decoded, in bounded memory | full: the whole "
        "video is decoded first (same bytes)",
    )
    p.add_argument(
        "--max-output-batch",
        type=int,
        default=4,
        help="several outputs of one prompt (num_outputs_per_prompt) denoise as one batch of up to N (default 4); "
        "1: one at a time, each exactly its single request at seed + i on any device (a batch is the same bytes "
        "where the kernels are batch-invariant, as on CPU)",
    )


def _add_kernel_args(r: argparse._ArgumentGroup) -> None:
    """Compile, attention and cache flags (and the recipe flags h3serve accepts as they are)."""
    r.add_argument("--omni", action="store_true", help="accepted: h3serve always serves video + audio")
    r.add_argument("--trust-remote-code", action="store_true", help="accepted: h3serve runs no checkpoint code")
    r.add_argument("--enforce-eager", action="store_true", help="never torch.compile the DiT")
    r.add_argument(
        "--diffusion-compile-granularity",
        help="regional (each DiT block; the default on GPU) | full; naming one also compiles on CPU",
    )
    r.add_argument(
        "--diffusion-compile-backend",
        default="inductor",
        help="inductor (the default) | aot_eager | eager: Dynamo capture only, no speed-up (to see graph breaks "
        "and recompiles cheaply)",
    )
    r.add_argument(
        "--diffusion-compile-dynamic",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="dynamic shapes (default on): one graph for every request shape",
    )
    r.add_argument("--diffusion-attention-backend",
                   help="auto | " + " | ".join(DENSE_ATTENTION) + " | FASTVIDEO_VSA (video sparse attention on the "
                   "DiT blocks: 64-row tiles, top-k of them per query tile; FastH3 8-step V2 needs it)")
    r.add_argument("--fastvideo-vsa-topk", type=int, metavar="K",
                   help="FASTVIDEO_VSA: key tiles each query tile keeps (default: sparsity 0.8, i.e. 20%% of the "
                   "tiles; a FastH3 V2 checkpoint pins its own)")
    r.add_argument("--diffusion-attention-config", "-dac", help='JSON, e.g. {"default": {"backend": "FLASH_ATTN"}}')
    r.add_argument("--fa-deterministic", action="store_true")
    r.add_argument("--ulysses-mode", help="strict | advanced_uaa")
    r.add_argument("--ulysses-a2a-permute", action="store_true")
    r.add_argument("--allgather-degree", type=int, default=1)
    r.add_argument(
        "--cache-backend", default="none",
        help="none | cache_dit (first-block residual caching of the DiT) | tea_cache (TeaCache on the FL2VA DiT: "
        "whole steps reuse the last computed block residual)",
    )
    r.add_argument(
        "--cache-config",
        help='cache_dit: JSON over the high profile, cache-dit names: {"residual_diff_threshold": 0.08, '
        '"Fn_compute_blocks": 1, "Bn_compute_blocks": 0, "max_warmup_steps": 4, "max_continuous_cached_steps": 1}; '
        'tea_cache: {"rel_l1_thresh": 0.17, "coefficients": [...]} (default: vLLM-Omni\'s FL2VA calibration)',
    )
    r.add_argument(
        "--timeline-guide-limits",
        help='JSON over the timeline guide limits (docs/guides.md), e.g. {"max_entries": 4, "max_guide_rows": 32768}',
    )


def _add_weight_args(r: argparse._ArgumentGroup) -> None:
    """Offload, quantization, adapter and start-up flags."""
    r.add_argument("--enable-cpu-offload", action="store_true")
    r.add_argument("--enable-layerwise-offload", action="store_true")
    r.add_argument("--enable-distributed-layerwise-offload", action="store_true")
    r.add_argument("--dlo-use-allgather", dest="dlo_use_allgather", action="store_const", const=True, default=None)
    r.add_argument("--dlo-no-use-allgather", dest="dlo_use_allgather", action="store_const", const=False)
    r.add_argument("--dlo-resident-layers", metavar="K|auto", help="first K main-DiT blocks stay on the device")
    r.add_argument(
        "--diffusion-offload-config",
        help='JSON: {"mode": "module"|"layer", "components": ["dit", ...], "weight_transfer", "resident_layers"}',
    )
    r.add_argument("--device-memory", help="memory per device for the placement plan, e.g. 32GiB (default: the GPU's)")
    r.add_argument(
        "--denoise-chunk-rows", metavar="N|auto|off",
        help="run each DiT block's working set in chunks of N rows (same math, less activation memory); auto "
        "(default): only when the placement would not fit otherwise",
    )
    r.add_argument("--quantization", help="fp8: FP8 weights for the DiTs and the text encoder (float8_e4m3fn)")
    r.add_argument(
        "--diffusion-quantization-config",
        help='JSON: {"granularity": "per_channel"|"per_tensor", "kernel": "auto"|"weight_only"|"fp8_gemm", '
        '"dit": {"exclude": ["transformer_blocks.0.*"], "adaln": false}, "dit_ref": true, "text_encoder": false}',
    )
    r.add_argument("--lora-path", action="append", metavar="NAME=PATH",
                   help="preload a LoRA adapter (file or directory) under NAME; repeatable")
    r.add_argument("--lora-scale", type=float, default=1.0, help="default scale of an adapter a request names")
    r.add_argument("--lora-dir", help="allow-listed root for a request's own lora.path (none: preloaded names only)")
    r.add_argument("--max-cpu-loras", type=int, default=4, help="adapters kept in host memory (LRU)")
    r.add_argument("--max-loras", type=int, default=2, help="adapters kept on the device (LRU)")
    r.add_argument("--max-lora-rank", type=int, help="device slot rank (default: largest preloaded; 128 w/ --lora-dir)")
    r.add_argument("--merge-lora", action="store_true",
                   help="a dedicated server of its one --lora-path adapter: fused into the DiT weights at load (at "
                   "--lora-scale), so its forward costs a base forward; every request runs it, another adapter or "
                   "scale is refused")
    r.add_argument("--lora-backend", help="peft (the only one: unmerged low-rank factors; see --merge-lora)")
    r.add_argument("--dit-adapter", metavar="PATH", help="a FastH3 adapter (file or folder) fused into the T2VA DiT")
    r.add_argument("--base-checkpoint", metavar="PATH",
                   help="a local MiniMax-H3 checkpoint whose FL2VA video and audio VAEs a FastH3 8-step V2 --model "
                   "decodes with (its provenance.json pins the revision; nothing is downloaded)")
    r.add_argument("--controlnet-model-path", metavar="FILE",
                   help="a Fun ControlNet Union file (.safetensors) beside the T2VA DiT: requests may carry a control "
                   "video (generate --control TYPE=FILE; HTTP extra_params.<type>)")
    r.add_argument("--realtime-lora", metavar="DIR",
                   help="TaoMate-H3's causal-streaming LoRA directory (adapter_model.safetensors + config.json): "
                   "enables real-time sessions (serve: WS /v1/realtime/video; generate: --duration S offline)")
    r.add_argument("--deploy-config")
    r.add_argument("--stage-overrides")
    r.add_argument("--step-execution", action="store_true")
    r.add_argument("--request-batch-max-wait-ms", type=int, default=0)
    r.add_argument("--enable-diffusion-pipeline-profiler", action="store_true")
    r.add_argument("--stage-init-timeout", type=float, help="seconds for the ranks to load (with --init-timeout)")
    r.add_argument("--init-timeout", type=float, help="seconds for the ranks to load (default 600)")
    r.add_argument("--api-server-count", type=int, default=1)


def _json_arg(flag: str, text: str | None) -> dict:

    if text is None:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{flag}: invalid JSON ({e})") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{flag}: expected a JSON object, got {type(value).__name__}")
    return value


def _check_dac_shape(dac: dict) -> None:
    """-dac is {"default": {"backend": NAME}, "per_role": {ROLE: {"backend": NAME}}}: refuse any other shape."""

    def backend_entry(where: str, value: object) -> None:
        if not isinstance(value, dict) or not isinstance(value.get("backend", ""), str):
            raise ConfigError(f'--diffusion-attention-config: {where} must be an object like {{"backend": "NAME"}}')

    unknown = sorted(set(dac) - {"default", "per_role"})
    if unknown:
        raise ConfigError(
            f"--diffusion-attention-config: unknown keys {', '.join(unknown)}; choose from: default, per_role"
        )
    if "default" in dac:
        backend_entry("default", dac["default"])
    roles = dac.get("per_role", {})
    if not isinstance(roles, dict):
        raise ConfigError('--diffusion-attention-config: per_role must be an object {ROLE: {"backend": NAME}}')
    for role, value in roles.items():
        backend_entry(f"per_role.{role}", value)


def _attention_backend(args: argparse.Namespace) -> tuple[str, tuple[tuple[str, str], ...]]:
    """(default backend, per-role overrides) from the flags; whether they can run is checked by EngineConfig."""

    dac = _json_arg("--diffusion-attention-config", args.diffusion_attention_config)
    _check_dac_shape(dac)
    from_dac = (dac.get("default") or {}).get("backend")
    if from_dac and args.diffusion_attention_backend:
        raise ConfigError(
            "--diffusion-attention-backend and --diffusion-attention-config's default.backend are mutually "
            "exclusive; give one of them"
        )
    name = args.diffusion_attention_backend or from_dac or "auto"
    if name in APPROXIMATE_ATTENTION:
        choices = ", ".join(("auto", *DENSE_ATTENTION, *SPARSE_ATTENTION))
        raise ConfigError(
            f"--diffusion-attention-backend {name}: would change the attention math, not available in h3serve; "
            f"choose from: {choices}"
        )
    roles = tuple(
        (role, cfg["backend"]) for role, cfg in sorted((dac.get("per_role") or {}).items()) if cfg.get("backend")
    )
    return name, roles


def _recipe_checks(args: argparse.Namespace, notices: list[str]) -> None:
    """Refuse what cannot work; give a one-line notice for what is applied differently or has no effect."""

    if args.api_server_count != 1:
        raise ConfigError(f"--api-server-count {args.api_server_count}: job state lives in one API process; use 1")
    if args.allgather_degree != 1:
        raise ConfigError(
            f"--allgather-degree {args.allgather_degree}: all-gather sequence parallel is not "
            "available; use --usp and/or --ring"
        )
    if args.cache_backend not in CACHE_BACKENDS:
        raise ConfigError(f"--cache-backend {args.cache_backend}: choose from: {', '.join(CACHE_BACKENDS)}")
    if args.cache_backend not in SERVED_CACHE_BACKENDS:
        served = ", ".join(SERVED_CACHE_BACKENDS)
        raise ConfigError(f"--cache-backend {args.cache_backend}: not available in h3serve; choose from: {served}")
    if args.cache_config and args.cache_backend == "none":
        notices.append("notice: --cache-config has no effect with --cache-backend none")
    if args.lora_backend not in (None, "peft"):
        raise ConfigError(f"--lora-backend {args.lora_backend}: h3serve applies LoRA unmerged; use peft or omit it")
    if args.deploy_config or args.stage_overrides:
        raise ConfigError(
            "--deploy-config/--stage-overrides: h3serve runs H3 as one stage; pass the parallel "
            "flags (--usp, --ring, --tensor-parallel-size, --text-encoder-tp-size, ...) directly"
        )
    if args.diffusion_compile_granularity not in (None, *COMPILE_GRANULARITIES):
        raise ConfigError(
            f"--diffusion-compile-granularity {args.diffusion_compile_granularity}: "
            f"choose from: {', '.join(COMPILE_GRANULARITIES)}"
        )
    if args.ulysses_mode not in (None, *ULYSSES_MODES):
        raise ConfigError(f"--ulysses-mode {args.ulysses_mode}: choose from: {', '.join(ULYSSES_MODES)}")
    if args.enforce_eager and (args.diffusion_compile_granularity or args.diffusion_compile_dynamic is not None):
        notices.append("notice: --diffusion-compile-*: no effect with --enforce-eager")
    if args.ulysses_mode == "advanced_uaa" or args.ulysses_a2a_permute:
        notices.append(
            "notice: --ulysses-mode/--ulysses-a2a-permute: h3serve pads the rows to equal chunks and "
            "exchanges q, k and v in one all-to-all; any sequence length works"
        )
    for flag, on, why in (
        ("--omni", args.omni, "h3serve always serves the omni (video + audio) pipeline"),
        ("--trust-remote-code", args.trust_remote_code, "h3serve runs no checkpoint code"),
        ("--vae-use-tiling", args.vae_use_tiling, "H3's VAE always decodes tiled"),
        ("--step-execution", args.step_execution, "cancellation is always checked between denoise steps"),
        ("--request-batch-max-wait-ms", args.request_batch_max_wait_ms, "requests run one at a time, unbatched"),
        (
            "--enable-diffusion-pipeline-profiler",
            args.enable_diffusion_pipeline_profiler,
            "stage durations are always measured",
        ),
        ("--fa-deterministic", args.fa_deterministic, "h3serve's attention forward is deterministic"),
    ):
        if on:
            notices.append(f"notice: {flag}: {why}")


def offload_config(args: argparse.Namespace) -> OffloadConfig:
    """The OffloadConfig of the offload flags; `ConfigError` with the fix for an illegal combination."""

    flags = OffloadFlags(
        enable_cpu_offload=args.enable_cpu_offload,
        enable_layerwise_offload=args.enable_layerwise_offload,
        enable_distributed_layerwise_offload=args.enable_distributed_layerwise_offload,
        dlo_use_allgather=args.dlo_use_allgather,
        dlo_resident_layers=args.dlo_resident_layers,
        diffusion_offload_config=args.diffusion_offload_config,
    )
    try:
        return offload_config_from_flags(flags)
    except OffloadError as e:
        raise ConfigError(str(e)) from None


def quantization(args: argparse.Namespace):
    """The QuantizationConfig of --quantization / --diffusion-quantization-config (None: full precision)."""
    try:
        return parse_quantization(args.quantization, args.diffusion_quantization_config)
    except QuantizationError as e:
        raise ConfigError(str(e)) from None
def adaln_memo(text: str | None) -> int | None:
    """--adaln-memo in bytes (the default size when absent; None for `off`); `ConfigError` for a bad size."""
    if text is not None and text.strip().lower() == "off":
        return None
    try:
        return parse_bytes(text, "--adaln-memo") if text else DEFAULT_ADALN_MEMO_BYTES
    except OffloadError as e:
        raise ConfigError(f"{e} (or 'off')") from None


def prompt_cache(text: str | None) -> int | None:
    """--prompt-cache in bytes (the default size when absent; None for `off`); `ConfigError` for a bad size."""
    if text is not None and text.strip().lower() == "off":
        return None
    try:
        return parse_bytes(text, "--prompt-cache") if text else DEFAULT_PROMPT_CACHE_BYTES
    except OffloadError as e:
        raise ConfigError(f"{e} (or 'off')") from None


def denoise_chunk_rows(text: str | None):
    """--denoise-chunk-rows: "auto" (absent), None (`off`) or a row count; `ConfigError` for a bad value."""
    try:
        return parse_denoise_chunk_rows(text)
    except OffloadError as e:
        raise ConfigError(str(e)) from None


def device_memory(text: str | None) -> int | None:
    """--device-memory in bytes (None when absent); `ConfigError` for a malformed size."""

    try:
        return parse_bytes(text) if text else None
    except OffloadError as e:
        raise ConfigError(str(e)) from None


def data_parallel_layout(args: argparse.Namespace) -> tuple[int, int]:
    """(ranks per replica, replicas) from --num-gpus and --data-parallel-size, as in vLLM-Omni: --num-gpus
    above tensor-parallel · ulysses · ring makes the remainder data-parallel. Ranks per replica 0: the product.

    Only when no flag asks for ranks beyond the DiT group: with --text-encoder-tp-size or
    --vae-patch-parallel-size above it, the extra ranks of one replica serve those (checked in `check_degrees`)."""

    dp = args.data_parallel_size
    if dp < 1:
        raise ConfigError(f"--data-parallel-size must be >= 1, got {dp}")
    if not args.num_gpus:
        return 0, dp
    if args.num_gpus % dp:
        raise ConfigError(f"--num-gpus {args.num_gpus} must be a multiple of --data-parallel-size {dp}")
    per_replica = args.num_gpus // dp
    dit_group = args.tensor_parallel_size * args.ulysses_degree * args.ring_degree
    extra_ranks_used = max(args.text_encoder_tp_size, args.vae_patch_parallel_size) > dit_group
    if per_replica > dit_group and per_replica % dit_group == 0 and not extra_ranks_used:
        return dit_group, dp * (per_replica // dit_group)
    return per_replica, dp


def layout_fields(args: argparse.Namespace) -> dict:
    """The EngineConfig fields that say which DiTs load and how the ranks split the work."""
    num_ranks, replicas = data_parallel_layout(args)
    return {
        "task_type": TASK_TYPE_ALIASES[args.task_type],
        "num_ranks": num_ranks,
        "data_parallel_size": replicas,
        "tensor_parallel_size": args.tensor_parallel_size,
        "ulysses_degree": args.ulysses_degree,
        "ring_degree": args.ring_degree,
        "text_encoder_tp_size": args.text_encoder_tp_size,
        "vae_patch_parallel_size": args.vae_patch_parallel_size,
    }


def collective_fields(args: argparse.Namespace) -> dict:
    """The EngineConfig fields of --collective-timeout: the timeout, and an idle keepalive well under it."""
    seconds = args.collective_timeout
    if seconds is None:
        return {}
    return {"collective_timeout_s": seconds, "idle_keepalive_s": min(EngineConfig.idle_keepalive_s, seconds / 4)}


def lora_fields(args: argparse.Namespace) -> dict:
    """The EngineConfig fields of the LoRA flags (`generate --lora PATH` preloads PATH under its own name)."""
    values = list(getattr(args, "lora_path", None) or [])
    if getattr(args, "lora", None):
        values.append(args.lora)
    paths = parse_lora_paths(values)
    fused = [path for _, path in paths if is_fasth3_path(path)]  # recognised by its identity, as vLLM-Omni does
    dit_adapter = getattr(args, "dit_adapter", None)
    if len(fused) + (dit_adapter is not None) > 1:
        raise ConfigError("--dit-adapter/--lora-path: one FastH3 adapter at most (it is fused into the weights)")
    return {
        "lora_paths": tuple((name, path) for name, path in paths if path not in fused),
        "dit_adapter": dit_adapter or (fused[0] if fused else None),
        "lora_scale": args.lora_scale,
        "lora_dir": args.lora_dir,
        "max_cpu_loras": args.max_cpu_loras,
        "max_loras": args.max_loras,
        "max_lora_rank": args.max_lora_rank,
        "merge_lora": bool(getattr(args, "merge_lora", False)),
    }


def engine_config_from_args(args: argparse.Namespace, model: Path | None = None) -> EngineConfig:
    """The validated `EngineConfig` for `add_engine_args` flags (`model`, else `args.model`); prints notices.

    Raises `ConfigError` with the fix in its message.
    """
    if args.task_type not in TASK_TYPE_ALIASES:
        raise ConfigError(f"--task-type: unknown {args.task_type!r}; choose from: {', '.join(TASK_TYPE_ALIASES)}")
    lines: list[str] = []
    _recipe_checks(args, lines)
    timeout = args.init_timeout or args.stage_init_timeout
    offload = offload_config(args)
    attention = _attention_backend(args)
    config = check_config(EngineConfig(
        model=Path(model if model is not None else args.model),
        base_checkpoint=Path(args.base_checkpoint) if getattr(args, "base_checkpoint", None) else None,
        device=args.device,
        dtype=args.dtype,
        threads=args.threads,
        qkv_layout=getattr(args, "qkv_layout", None),
        **layout_fields(args),
        **collective_fields(args),
        vae_parallel_mode=args.vae_parallel_mode,
        cfg_parallel_size=args.cfg_parallel_size,
        enforce_eager=args.enforce_eager,
        compile_granularity=args.diffusion_compile_granularity,
        compile_dynamic=args.diffusion_compile_dynamic is not False,
        compile_backend=args.diffusion_compile_backend,
        attention_backend=attention[0],
        attention_per_role=attention[1],
        vsa_topk=getattr(args, "fastvideo_vsa_topk", None),
        cache_backend=args.cache_backend,
        cache_config=json.dumps(_json_arg("--cache-config", args.cache_config), sort_keys=True)
        if args.cache_config
        else "",
        timeline_guide_limits=args.timeline_guide_limits or "",
        offload=offload,
        decode_mode=args.decode_mode,
        max_output_batch=args.max_output_batch,
        device_memory=device_memory(args.device_memory),
        denoise_chunk_rows=denoise_chunk_rows(args.denoise_chunk_rows),
        quantization=quantization(args),
        **lora_fields(args),
        adaln_memo_bytes=adaln_memo(args.adaln_memo),
        prompt_cache_bytes=prompt_cache(getattr(args, "prompt_cache", None)),
        warmup=warmup_shapes(getattr(args, "warmup", None)),
        adaln_cache_dir=Path(args.adaln_cache_dir) if args.adaln_cache_dir else None,
        controlnet_model_path=getattr(args, "controlnet_model_path", None),
        realtime_lora=getattr(args, "realtime_lora", None),
        **({"init_timeout_s": timeout} if timeout else {}),
    ))
    lines += notices(config)
    for line in lines:
        print(line, file=sys.stderr)
    return config
