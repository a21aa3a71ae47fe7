"""The torch-free start-up checks of an `EngineConfig`: every flag against its names and ranges, the checkpoint,
its adapters and the rooms' own refusals (`check_config`), and the notices printed once at start-up. The parent runs
them before an engine starts; each rank runs `h3serve.rank.device_checks.check_engine` for what only torch can tell,
with the same `ConfigError` messages."""

from __future__ import annotations

from pathlib import Path

from h3serve.accel.cache_profile import backend_refusal, server_cache_profile
from h3serve.adapters.fasth3 import read_fasth3
from h3serve.adapters.header import AdapterError
from h3serve.adapters.serving import catalog_for, dit_config, engine_defaults, lora_enabled
from h3serve.adapters.taomate import inspect_taomate, is_taomate_dir
from h3serve.checkpoint import fasth3_v2
from h3serve.checkpoint.resolver import CheckpointError, CheckpointLayout, read_layout
from h3serve.config.engine_config import (
    COMPILE_BACKENDS,
    DECODE_MODES,
    DEVICE,
    WARMUP_DEFAULT,
    WARMUP_PROMPT,
    WARMUP_SHAPE,
    WARMUP_STEPS,
    EngineConfig,
)
from h3serve.config.offload_config import AUTO, MIN_DENOISE_CHUNK_ROWS, OffloadError, check_resident_layers
from h3serve.errors import ConfigError
from h3serve.extras import require
from h3serve.parallel.degrees import ParallelDegrees, check_degrees, parallel_notices, read_model_dims
from h3serve.rules import limits
from h3serve.rules.defaults import ModelDefaults
from h3serve.rules.guide_limits import GuideLimits
from h3serve.rules.names import CACHE_BACKENDS, TASK_TYPES
from h3serve.rules.request import GenerationRequest
from h3serve.rules.validate import RequestError, validate


def check_config(config: EngineConfig) -> EngineConfig:
    """Fail loudly, at start-up, on any illegal value (the torch-free checks; the rank runs the others)."""
    _check_device(config)
    _check_sparse_attention(config)
    _check_processes(config)
    _check_compile_and_cache(config)
    _check_model(config)
    _check_lora(config)
    _check_controlnet(config)
    _check_realtime(config)
    _check_warmup(config)
    GuideLimits.from_flag(config.timeline_guide_limits)
    return config


def _check_device(config: EngineConfig) -> None:
    if not DEVICE.fullmatch(config.device):
        raise ConfigError(f"--device: unknown device {config.device!r}; choose from: auto, cpu, cuda, cuda:N")
    if config.device.startswith("cuda:") and config.world_size * config.data_parallel_size > 1:
        # each rank takes its own GPU by local rank
        raise ConfigError(
            f"--device {config.device} names one GPU, but this engine runs "
            f"{config.world_size * config.data_parallel_size} ranks (one GPU each, by local rank); use --device cuda "
            "and choose the GPUs with CUDA_VISIBLE_DEVICES"
        )
    config.dtype_name()
    if config.device_memory is not None and config.device_memory <= 0:
        raise ConfigError(f"--device-memory must be > 0, got {config.device_memory}")
    if config.prompt_cache_bytes is not None and config.prompt_cache_bytes <= 0:
        raise ConfigError(f"--prompt-cache must be a positive size (or 'off'), got {config.prompt_cache_bytes}")
    if config.threads < 0:
        raise ConfigError(f"--threads must be >= 0, got {config.threads}")
    chunk = config.denoise_chunk_rows
    if chunk not in (AUTO, None) and (not isinstance(chunk, int) or chunk < MIN_DENOISE_CHUNK_ROWS):
        raise ConfigError(f"--denoise-chunk-rows: must be >= {MIN_DENOISE_CHUNK_ROWS} rows (or 'auto', 'off'), "
                          f"got {chunk!r}")


def _check_processes(config: EngineConfig) -> None:
    if config.task_type not in TASK_TYPES:
        raise ConfigError(f"--task-type: unknown {config.task_type!r}; choose from: {', '.join(TASK_TYPES)}")
    if config.qkv_layout not in (None, "interleaved", "stacked"):
        raise ConfigError(f"--qkv-layout: unknown {config.qkv_layout!r}; choose from: interleaved, stacked")
    if config.num_ranks < 0:
        raise ConfigError(
            f"--num-gpus must be >= 1 (or 0: the product of the parallel degrees), got {config.num_ranks}"
        )
    if config.data_parallel_size < 1:
        raise ConfigError(f"--data-parallel-size must be >= 1, got {config.data_parallel_size}")
    if config.init_timeout_s <= 0:
        raise ConfigError(f"--init-timeout must be > 0 seconds, got {config.init_timeout_s:g}")
    if config.collective_timeout_s is not None and config.collective_timeout_s <= 0:
        raise ConfigError(f"--collective-timeout must be > 0 seconds, got {config.collective_timeout_s:g}")
    if not 0 < config.idle_keepalive_s < (config.collective_timeout_s or float("inf")):
        raise ConfigError("idle_keepalive_s must be > 0 and shorter than collective_timeout_s")
    if not 1 <= config.max_output_batch <= limits.MAX_OUTPUTS_PER_PROMPT:
        raise ConfigError(
            f"--max-output-batch {config.max_output_batch}: must be between 1 and {limits.MAX_OUTPUTS_PER_PROMPT}"
        )
    if config.decode_mode not in DECODE_MODES:
        raise ConfigError(f"--decode-mode {config.decode_mode}: choose from: {', '.join(DECODE_MODES)}")


def _check_compile_and_cache(config: EngineConfig) -> None:
    if config.compile_granularity not in (None, "regional", "full"):
        raise ConfigError(
            f"--diffusion-compile-granularity {config.compile_granularity}: choose from: regional, full"
        )
    if config.compile_backend not in COMPILE_BACKENDS:
        raise ConfigError(
            f"--diffusion-compile-backend {config.compile_backend}: choose from: {', '.join(COMPILE_BACKENDS)}"
        )
    if config.full_graph and (config.ulysses_degree * config.ring_degree > 1 or config.offload.enabled):
        raise ConfigError(
            "diffusion_compile_granularity='full' is incompatible with sequence parallelism and offload; "
            "use 'regional' compilation instead"
        )
    if config.cache_backend not in CACHE_BACKENDS:
        raise ConfigError(f"--cache-backend {config.cache_backend}: choose from: {', '.join(CACHE_BACKENDS)}")
    if config.cache_backend == "cache_dit":
        require("cache", "--cache-backend cache_dit")
    server_cache_profile(config)
    refusal = backend_refusal(config)
    if refusal:
        raise ConfigError(f"--cache-backend {config.cache_backend} is not available with {refusal}")
    if config.cache_backend == "tea_cache" and "transformer" not in config.dits:
        raise ConfigError(  # vLLM-Omni's refusal of a Ref2VA partition
            "--cache-backend tea_cache: TeaCache only supports the MiniMax-H3 FL2VA partition; Ref2VA TeaCache "
            "has not been calibrated (its coefficients were fitted on the FL2VA DiT); use --task-type fl2va or "
            "auto, or --cache-backend cache_dit"
        )


def _check_model(config: EngineConfig) -> None:
    try:  # the one resolver (modular root, native FL2VA/Ref2VA tree or variant folder): gaps named
        layout = read_layout(config.model, config.dits, base=config.base_checkpoint)
    except CheckpointError as e:
        raise ConfigError(f"--model: {e}") from None
    if layout.contract is not None:
        _check_fasth3_v2(config, layout, layout.contract)
    dims = read_model_dims(config.model, config.dits)
    check_degrees(ParallelDegrees.of(config), dims, config.cfg_parallel_size, config.vae_parallel_mode)
    if isinstance(config.offload.resident_layers, int) and config.offload.resident_layers:
        try:
            check_resident_layers(config.offload.resident_layers, dims.dit_layers)
        except OffloadError as e:
            raise ConfigError(str(e)) from None
    if config.offload.adaln and config.adaln_memo_bytes is None:
        raise ConfigError(
            '"adaln" in --diffusion-offload-config keeps the AdaLN projections off the device, which needs the '
            "AdaLN memo (modulations computed once per request); drop --adaln-memo off"
        )
    if config.adaln_cache_dir is not None and config.adaln_memo_bytes is None:
        raise ConfigError("--adaln-cache-dir fills the AdaLN memo, which --adaln-memo off turns off; drop one")


def _check_fasth3_v2(config: EngineConfig, layout: CheckpointLayout, contract: fasth3_v2.FastH3Contract) -> None:
    """A FastH3 V2 tree's start-up contract (vLLM-Omni's): its base VAEs named, video sparse attention on, no
    top-k override, no LoRA or fused adapter (sequence parallelism: refused with VSA itself)."""
    flag = f"--model {config.model.name} ({fasth3_v2.NAME})"
    if config.base_checkpoint is None:
        try:
            layout.component("vae")
        except CheckpointError as e:
            raise ConfigError(f"{flag}: {e}") from None
    if not config.sparse_attention:
        raise ConfigError(f"{flag}: its DiT was distilled with video sparse attention (VIDEO_SPARSE_ATTN_H3); "
                          "start with --diffusion-attention-backend FASTVIDEO_VSA")
    if config.vsa_topk is not None:
        raise ConfigError(f"{flag}: its inference contract pins VSA sparsity {contract.sparsity:g}; "
                          "drop --fastvideo-vsa-topk")
    if lora_enabled(config) or config.dit_adapter is not None:
        raise ConfigError(f"{flag}: a distilled checkpoint runs no LoRA; drop --lora-path/--lora-dir/--dit-adapter")


def _check_sparse_attention(config: EngineConfig) -> None:
    """VSA runs on whole rows of one rank's heads: no sequence parallelism; its top-k only with it."""
    if config.vsa_topk is not None and (not config.sparse_attention or config.vsa_topk < 1):
        raise ConfigError(f"--fastvideo-vsa-topk {config.vsa_topk}: a positive tile count, with "
                          "--diffusion-attention-backend FASTVIDEO_VSA")
    if not config.sparse_attention:
        return
    if config.ulysses_degree * config.ring_degree > 1:
        raise ConfigError("--diffusion-attention-backend FASTVIDEO_VSA: video sparse attention runs on every row "
                          "of a rank's heads; not with --usp/--ring (tensor parallelism works)")
    if config.realtime_lora is not None:
        raise ConfigError("--diffusion-attention-backend FASTVIDEO_VSA: real-time sessions attend through their "
                          "K/V cache; not with --realtime-lora")


def _check_lora(config: EngineConfig) -> None:
    if config.dit_adapter is not None:
        if "transformer" not in config.dits:
            raise ConfigError("--dit-adapter: a FastH3 adapter serves T2VA; load that DiT (--task-type fl2va)")
        try:
            read_fasth3(config.dit_adapter)
        except AdapterError as e:
            raise ConfigError(f"--dit-adapter {config.dit_adapter}: {e}") from None
    _check_merge_lora(config)
    if not lora_enabled(config):
        return
    if config.max_cpu_loras < 1 or config.max_loras < 1:
        raise ConfigError("--max-cpu-loras and --max-loras must be >= 1")
    if config.max_lora_rank is not None and config.max_lora_rank < 1:
        raise ConfigError(f"--max-lora-rank must be >= 1, got {config.max_lora_rank}")
    if config.lora_dir is not None and not Path(config.lora_dir).is_dir():
        raise ConfigError(f"--lora-dir {config.lora_dir}: not a directory")
    try:
        catalog = catalog_for(config, log=lambda text: None)
    except AdapterError as e:
        raise ConfigError(str(e)) from None
    for name, choice in sorted(catalog.preloaded.items() if catalog is not None else ()):
        if config.merge_lora and choice.pdd is not None:
            raise ConfigError(f"--merge-lora {name}: a PDD adapter also swaps the DiT's output heads per step and "
                              "trains the AdaLN projections; it is served unmerged (drop --merge-lora)")
        if choice.flashgen is not None:
            _check_flashgen(config, name)


def _check_merge_lora(config: EngineConfig) -> None:
    """--merge-lora: a dedicated server of one adapter, fused into the weights; what cannot go with it, refused
    with the reason (a PDD adapter once `_check_lora` has read the catalog)."""
    if not config.merge_lora:
        return
    if len(config.lora_paths) != 1 or config.lora_dir is not None:
        given = f"{len(config.lora_paths)} --lora-path" + (" and --lora-dir" if config.lora_dir else "")
        raise ConfigError(f"--merge-lora fuses the server's one adapter into the weights: give exactly one "
                          f"--lora-path and no --lora-dir (got {given}); a server that switches adapters per "
                          "request runs them unmerged")
    (name, path), flag = config.lora_paths[0], "--merge-lora"
    if config.dit_adapter is not None:
        raise ConfigError(f"{flag}: this server already fuses the FastH3 adapter {Path(config.dit_adapter).name}; "
                          "fuse one adapter at most")
    if config.realtime_lora is not None:
        raise ConfigError(f"{flag}: real-time sessions run the base DiT beside their streaming LoRA "
                          "(--realtime-lora); a merged adapter would change every session's weights")
    if is_taomate_dir(path):
        raise ConfigError(f"{flag} {name}: a TaoMate-H3 streaming LoRA serves real-time sessions "
                          "(--realtime-lora), unmerged")


def _check_flashgen(config: EngineConfig, name: str) -> None:
    """A preloaded FlashGen LoRA: refused where vLLM-Omni refuses it (Ref2VA, a checkpoint or adapter that
    already pins a base schedule, model-level or layerwise DiT offload), and wherever h3serve cannot keep the
    AdaLN projections it trains resident."""
    flag = f"--lora-path {name}"
    if "transformer" not in config.dits:
        raise ConfigError(f"{flag}: a FlashGen LoRA adapts the FL2VA DiT (T2VA); Ref2VA is refused; load the "
                          "FL2VA DiT (--task-type fl2va or auto)")
    if config.dit_adapter is not None:
        raise ConfigError(f"{flag}: a FlashGen LoRA brings its own base schedule, and the fused FastH3 adapter "
                          "already pins one; drop one of them")
    dit_offloaded = (config.offload.staged_components() | config.offload.streamed_components()) & set(config.dits)
    if dit_offloaded or config.offload.adaln_on_host(config.adaln_memo_bytes is not None):
        raise ConfigError(f"{flag}: a FlashGen LoRA trains every block's AdaLN projection; model-level and "
                          "layerwise DiT offload are refused with it (as vLLM-Omni does), and so is any DiT "
                          "offload here (h3serve applies AdaLN factors to resident projections only)")


def _check_controlnet(config: EngineConfig) -> None:
    """The combinations the control branch does not run in, refused with the reason."""
    path = config.controlnet_model_path
    if path is None:
        return
    flag = f"--controlnet-model-path {Path(path).name}"
    if not Path(path).is_file() or Path(path).suffix != ".safetensors":
        raise ConfigError(f"{flag}: not a .safetensors file")
    if "transformer" not in config.dits:
        raise ConfigError(f"{flag}: the control branch steers T2VA; load that DiT (--task-type fl2va or auto)")
    if config.ulysses_degree > 1 or config.ring_degree > 1:
        raise ConfigError(f"{flag}: the control branch runs on the whole packed sequence; not with --usp/--ring "
                          "(tensor parallelism works)")
    if config.offload.enabled:
        raise ConfigError(f"{flag}: the control blocks stay resident; not with DiT or component offload")
    if config.cache_backend != "none":
        raise ConfigError(f"{flag}: the hints enter between the DiT's blocks; not with --cache-backend")


def _check_realtime(config: EngineConfig) -> None:
    """What vLLM-Omni's TaoMate-H3 refuses (pure Ulysses, TP 1, the FL2VA DiT), and the adapter itconfig."""
    if config.realtime_lora is None:
        return
    flag = f"--realtime-lora {Path(config.realtime_lora).name}"
    if "transformer" not in config.dits:
        raise ConfigError(f"{flag}: real-time sessions run on the FL2VA (T2VA) DiT; load it (--task-type fl2va "
                          "or auto)")
    if config.tensor_parallel_size > 1:
        raise ConfigError(f"{flag}: real-time sessions run with pure Ulysses sequence parallelism (the LoRA is "
                          "replicated, the clean K/V cache sharded by heads); use --usp instead of -tp")
    if config.ring_degree > 1:
        raise ConfigError(f"{flag}: the clean K/V cache holds whole rows per head shard; use --usp, not --ring")
    if config.cache_backend != "none":
        raise ConfigError(f"{flag}: a real-time chunk runs three steps conditioned on cached K/V; a DiT block "
                          "cache does not apply (drop --cache-backend)")
    if config.full_graph:
        raise ConfigError(f"{flag}: the causal attention runs eagerly between compiled blocks; use "
                          "diffusion_compile_granularity='regional'")
    try:
        info = inspect_taomate(config.realtime_lora, dit_config(config.model, config.dits))
    except AdapterError as e:
        raise ConfigError(f"{flag}: {e}") from None
    if config.max_lora_rank is not None and config.max_lora_rank < info.rank:
        raise ConfigError(f"--max-lora-rank {config.max_lora_rank}: smaller than the real-time LoRA's rank "
                          f"{info.rank}")


def _check_warmup(config: EngineConfig) -> None:
    """Every --warmup shape is a request this checkpoint serves (a bad one is refused before a weight is read)."""
    if not config.warmup:
        return
    defaults = engine_defaults(config, read_layout(config.model, config.dits).defaults())
    if "transformer" not in config.dits:
        raise ConfigError("--warmup runs T2VA requests, on the FL2VA DiT; this engine loads only the Ref2VA DiT "
                          "(--task-type ref2va): use --warmup off")
    for shape, request in zip(config.warmup, warmup_requests(config, defaults), strict=True):
        try:
            validate(request, defaults)
        except RequestError as e:
            raise ConfigError(f"--warmup {shape}: {e}") from None


def warmup_requests(config: EngineConfig, defaults: ModelDefaults) -> list[GenerationRequest]:
    """The requests --warmup names, as a client would send them (checked against the checkpoint's rules by
    `check_config`): the default shape or WIDTHxHEIGHTxFRAMES, T2VA, a fixed prompt, `WARMUP_STEPS` forwards (the
    engine's `defaults` may pin a schedule, which keeps its own count)."""
    requests = []
    merged = defaults.merged_lora
    pinned = defaults.pinned_schedule is not None or (merged is not None and (merged.turbo or merged.pdd))
    for shape in config.warmup:
        steps = None if pinned else WARMUP_STEPS
        width = height = frames = None  # the default shape
        if shape != WARMUP_DEFAULT:
            match = WARMUP_SHAPE.fullmatch(shape)
            if match is None:
                raise ConfigError(f"--warmup {shape}: expected {WARMUP_DEFAULT}, off or WIDTHxHEIGHTxFRAMES "
                                  "such as 1344x768x124")
            width, height, frames = (int(g) for g in match.groups())
        requests.append(GenerationRequest(prompt=WARMUP_PROMPT, steps=steps, seed=0, width=width, height=height,
                                          num_frames=frames))
    return requests


def notices(config: EngineConfig) -> list[str]:
    """One line per flag applied in a way the user may not expect (printed once, at start-up). The device's
    own lines only when --device names it (for `auto` the rank prints them: `device_notices`)."""
    notices = parallel_notices(ParallelDegrees.of(config))
    if config.data_parallel_size > 1:
        notices.append(
            f"notice: {config.data_parallel_size} data-parallel engine replicas of {config.world_size} "
            f"rank(s) each: up to {config.data_parallel_size} jobs run at once"
        )
    if config.device_type is not None:
        notices += device_notices(config, config.device_type)
    if config.cache_backend == "tea_cache" and "transformer_ref" in config.dits:
        notices.append("notice: --cache-backend tea_cache caches the FL2VA DiT only (T2VA and FL2VA requests); "
                       "Ref2VA requests run uncached (TeaCache is not calibrated for the Ref2VA DiT)")
    return notices


def device_notices(config: EngineConfig, device_type: str) -> list[str]:
    """The notices that depend on the device (all about CPU)."""
    if device_type != "cpu":
        return []
    notices = []
    if config.offload.enabled:
        notices.append(
            "notice: offload on CPU: the compute device is host memory, so weights move by reference "
            "(placement is still carried out and accounted)"
        )
    if config.world_size > 1:
        notices.append(f"notice: --num-gpus {config.world_size} on CPU: {config.world_size} rank processes over gloo")
    if config.dtype in ("bfloat16", "float16"):
        notices.append(f"notice: --dtype {config.dtype} on CPU is very slow on most CPUs; float32 is the CPU default")
    return notices
