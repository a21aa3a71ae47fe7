"""EngineConfig: every engine flag, parsed and cross-checked once at start-up (frozen).

No torch here: the API process builds, checks and ships an `EngineConfig` without loading it. What only torch can
tell (which device `auto` is, whether a GPU or a kernel is there) each rank checks before it reads a weight
(`h3serve.rank.device_checks`), with the same `ConfigError` messages.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from h3serve.accel.cache_profile import CacheConfigError, CacheProfile, ServerCache, TeaCacheProfile
from h3serve.accel.quant_config import QuantizationConfig
from h3serve.adapters.fasth3 import read_fasth3
from h3serve.adapters.header import AdapterError
from h3serve.adapters.serving import catalog_for, dit_config, engine_defaults, lora_enabled
from h3serve.adapters.taomate import inspect_taomate, is_taomate_dir
from h3serve.checkpoint import fasth3_v2
from h3serve.checkpoint.resolver import CheckpointError, CheckpointLayout, read_layout
from h3serve.errors import ConfigError
from h3serve.extras import require
from h3serve.offload.modes import (
    AUTO,
    MIN_DENOISE_CHUNK_ROWS,
    DenoiseChunk,
    OffloadConfig,
    OffloadError,
    check_resident_layers,
)
from h3serve.parallel.degrees import ParallelDegrees, check_degrees, parallel_notices, read_model_dims
from h3serve.rules import limits
from h3serve.rules.defaults import ModelDefaults
from h3serve.rules.names import CACHE_BACKENDS, TASK_TYPES
from h3serve.rules.request import GenerationRequest
from h3serve.rules.validate import RequestError, validate

DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")  # the --device values; `auto` is resolved by each rank (torch)
DTYPES = ("float32", "bfloat16", "float16")
DECODE_MODES = ("stream", "full")
COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")  # torch.compile backends the engine accepts
DEFAULT_ADALN_MEMO_BYTES = 4 * 2**30  # the AdaLN memo's host store: a few requests' schedules of the released DiT
DEFAULT_PROMPT_CACHE_BYTES = 256 * 2**20  # the prompt cache's host store: ~150 released-size prompts of 200 tokens
WARMUP_SHAPE = re.compile(r"([1-9][0-9]*)x([1-9][0-9]*)x([1-9][0-9]*)")  # --warmup WIDTHxHEIGHTxFRAMES
WARMUP_DEFAULT = "default"  # --warmup: the checkpoint's default request shape
WARMUP_PROMPT = "warm-up"
WARMUP_STEPS = 2  # a warm-up request's forwards (a pinned schedule keeps its own): every path, no more


def warmup_shapes(text: str | None) -> tuple[str, ...]:
    """--warmup: "off" -> none; "default" and WIDTHxHEIGHTxFRAMES shapes, comma-separated (checked by EngineConfig);
    absent (`generate`, which runs one request anyway) -> none."""
    if text is None or text.strip().lower() == "off":
        return ()
    shapes = tuple(part.strip().lower() for part in text.split(",") if part.strip())
    if not shapes:
        raise ConfigError("--warmup: give default, off or WIDTHxHEIGHTxFRAMES shapes separated by commas")
    return shapes


@dataclass(frozen=True)
class EngineConfig:
    model: Path  # checkpoint root (modular layout)
    base_checkpoint: Path | None = None  # --base-checkpoint: the MiniMax-H3 tree whose VAEs a FastH3 V2 tree uses
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: str = "auto"  # auto (bf16 on GPU, fp32 on CPU) | float32 | bfloat16 | float16
    threads: int = 0  # CPU intra-op threads; 0 = torch's default
    num_ranks: int = 0  # rank processes of one replica (one per GPU); 0 = tensor_parallel_size·ulysses·ring
    data_parallel_size: int = 1  # engine replicas, each its own rank group running its own job
    task_type: str = "auto"  # auto: every DiT the checkpoint has | fl2va (t2va + fl2va) | ref2va
    qkv_layout: str | None = None  # a native DiT's fused QKV rows: interleaved | stacked; None: config or interleaved
    # Multi-rank execution (h3serve.parallel); checked against the checkpoint's shapes in `validate`.
    tensor_parallel_size: int = 1  # DiT tensor parallel: heads and FFN columns split over TP ranks
    ulysses_degree: int = 1  # --usp: Ulysses sequence parallel (all-to-all rows <-> heads)
    ring_degree: int = 1  # --ring: Ring sequence parallel (key/value blocks passed around)
    text_encoder_tp_size: int = 1  # Qwen3-VL tensor parallel on the first N ranks
    vae_patch_parallel_size: int = 1  # VAE decode tiles over ranks: 1 or every rank
    vae_parallel_mode: str = "tile"  # the only mode H3's VAE has
    cfg_parallel_size: int = 1  # must be 1: H3 is CFG-distilled
    enforce_eager: bool = False  # never torch.compile the DiT
    # torch.compile of the DiT (h3serve.accel.compile). None: regional on CUDA, eager on CPU (where inductor's
    # C++ build takes minutes); naming a granularity compiles on CPU too.
    compile_granularity: str | None = None  # regional (each block) | full (the whole forward)
    compile_dynamic: bool = True  # dynamic shapes: one graph for every request shape, no recompile storm
    compile_backend: str = "inductor"  # aot_eager / eager: Dynamo capture only (graph breaks, recompiles)
    attention_backend: str = "auto"  # --diffusion-attention-backend (h3serve.accel.attention); auto: TORCH_SDPA
    attention_per_role: tuple[tuple[str, str], ...] = ()  # -dac per_role: (role, backend) overrides
    vsa_topk: int | None = None  # --fastvideo-vsa-topk: VSA's key tiles per query tile (None: sparsity 0.8)
    # none | cache_dit (h3serve.accel.cache: first-block residual caching) | tea_cache (h3serve.accel.teacache)
    cache_backend: str = "none"
    cache_config: str = ""  # --cache-config JSON object: DBCache parameters over `high`, or TeaCache's
    init_timeout_s: float = 600.0  # --init-timeout: seconds the ranks may take to load
    idle_keepalive_s: float = 60.0  # idle multi-rank engines exchange a keepalive this often (under the PG timeout)
    collective_timeout_s: float | None = None  # --collective-timeout (process group); None: torch's (gloo 30 min)
    offload: OffloadConfig = field(default_factory=OffloadConfig)  # staged / streamed components (h3serve.offload)
    decode_mode: str = "stream"  # stream: VAE clips into the MP4 as they are decoded | full: whole arrays first
    # Several outputs of one prompt denoise as one batch of up to this many (h3serve.model.pipeline); 1: one at a
    # time, each exactly its single request on any device. The default is 4.
    max_output_batch: int = 4
    device_memory: int | None = None  # --device-memory: bytes per device for the plan's verdict; None: ask the GPU
    quantization: QuantizationConfig | None = None  # --quantization fp8 (h3serve.accel.quant_config); None: full
    # Per-request LoRA (h3serve.adapters, h3serve.rank.lora): preloaded (name, path), their default scale, the
    # allow-listed root for request paths, the host / device adapter caches and the device slot rank.
    lora_paths: tuple[tuple[str, str], ...] = ()
    lora_scale: float = 1.0
    lora_dir: str | None = None
    max_cpu_loras: int = 4
    max_loras: int = 2
    max_lora_rank: int | None = None
    # --merge-lora: the one --lora-path adapter is fused into every loaded DiT's weights at load (at --lora-scale),
    # so its forward costs a base forward; the server then serves that adapter only (h3serve.adapters.serving).
    merge_lora: bool = False
    dit_adapter: str | None = None  # --dit-adapter: a FastH3 file fused into the T2VA DiT at load (rank.fasth3_fusion)
    controlnet_model_path: str | None = None  # a Fun ControlNet Union file beside the T2VA DiT (rank.controlnet)
    # --realtime-lora: TaoMate-H3's causal-streaming LoRA directory (h3serve.adapters.taomate); enables real-time
    # sessions (h3serve.rank.realtime_loop) on the T2VA DiT, applied unmerged beside any per-request LoRA.
    realtime_lora: str | None = None
    # Exact AdaLN memoisation (h3serve.model.adaln_memo): the host store's bytes; None (--adaln-memo off): each
    # forward computes its modulations.
    adaln_memo_bytes: int | None = DEFAULT_ADALN_MEMO_BYTES
    adaln_cache_dir: Path | None = None  # --adaln-cache-dir: start-up sidecars of the default schedules
    # The prompt cache (h3serve.model.prompt_cache): text states of recent prompts in host memory, at most this many
    # bytes; None (--prompt-cache off): every request runs the text encoder.
    prompt_cache_bytes: int | None = DEFAULT_PROMPT_CACHE_BYTES
    # --warmup: T2VA request shapes ("default" or WxHxFRAMES) each rank runs once before the engine reports ready
    # (h3serve.rank.warmup): compile, kernel plans, the allocator's pools and the default schedule's AdaLN memo are
    # then paid before the first request. `serve` warms the default shape unless told otherwise; () here: none.
    warmup: tuple[str, ...] = ()
    # --denoise-chunk-rows: a DiT block's working set in chunks of this many rows ("auto": the planner chunks only a
    # configuration that would not fit whole; None: never). Resolved to a number or None at start-up.
    denoise_chunk_rows: DenoiseChunk = AUTO

    @property
    def dits(self) -> tuple[str, ...]:
        """Which DiT components to load."""
        return {"auto": ("transformer", "transformer_ref"), "fl2va": ("transformer",), "ref2va": ("transformer_ref",)}[
            self.task_type
        ]

    @property
    def world_size(self) -> int:
        return self.num_ranks or self.tensor_parallel_size * self.ulysses_degree * self.ring_degree

    @property
    def device_type(self) -> str | None:
        """The device kind --device names (cpu, cuda); None for `auto`, which only a rank can resolve (torch)."""
        return None if self.device == "auto" else self.device.split(":")[0]

    def parallel_degrees(self) -> ParallelDegrees:
        """The degrees as an `h3serve.parallel.degrees.ParallelDegrees`."""
        return ParallelDegrees(
            tensor_parallel=self.tensor_parallel_size,
            ulysses=self.ulysses_degree,
            ring=self.ring_degree,
            text_encoder_tp=self.text_encoder_tp_size,
            vae_patch_parallel=self.vae_patch_parallel_size,
            world_size=self.world_size,
        )

    def notices(self) -> list[str]:
        """One line per flag applied in a way the user may not expect (printed once, at start-up). The device's
        own lines only when --device names it (for `auto` the rank prints them: `device_notices`)."""
        notices = parallel_notices(self.parallel_degrees())
        if self.data_parallel_size > 1:
            notices.append(
                f"notice: {self.data_parallel_size} data-parallel engine replicas of {self.world_size} "
                f"rank(s) each: up to {self.data_parallel_size} jobs run at once"
            )
        if self.device_type is not None:
            notices += self.device_notices(self.device_type)
        if self.cache_backend == "tea_cache" and "transformer_ref" in self.dits:
            notices.append("notice: --cache-backend tea_cache caches the FL2VA DiT only (T2VA and FL2VA requests); "
                           "Ref2VA requests run uncached (TeaCache is not calibrated for the Ref2VA DiT)")
        return notices

    def device_notices(self, device_type: str) -> list[str]:
        """The notices that depend on the device (all about CPU)."""
        if device_type != "cpu":
            return []
        notices = []
        if self.offload.enabled:
            notices.append(
                "notice: offload on CPU: the compute device is host memory, so weights move by reference "
                "(placement is still carried out and accounted)"
            )
        if self.world_size > 1:
            notices.append(f"notice: --num-gpus {self.world_size} on CPU: {self.world_size} rank processes over gloo")
        if self.dtype in ("bfloat16", "float16"):
            notices.append(f"notice: --dtype {self.dtype} on CPU is very slow on most CPUs; float32 is the CPU default")
        return notices

    def cache_profile(self) -> ServerCache | None:
        """The server's cache (`h3serve.accel.cache_profile`): a Cache-DiT `CacheProfile` (cache_dit), a
        `TeaCacheProfile` (tea_cache), or None without --cache-backend."""
        if self.cache_backend == "none":
            return None
        try:
            data = json.loads(self.cache_config or "{}")
            if not isinstance(data, dict):
                raise CacheConfigError(f"--cache-config: expected a JSON object, got {type(data).__name__}")
            if self.cache_backend == "tea_cache":
                return TeaCacheProfile.from_json(data)
            return CacheProfile.from_json(data)
        except (CacheConfigError, TypeError, json.JSONDecodeError) as e:
            raise ConfigError(str(e)) from None

    @property
    def server_cache(self) -> str | None:
        """--cache-backend as the request rules see it: the cache a request that omits `quality` runs under."""
        return None if self.cache_backend == "none" else self.cache_backend

    def backend_refusal(self, device_type: str | None = None) -> str | None:
        """Why this engine cannot run its --cache-backend (None: it can, or there is none)."""
        if self.cache_backend == "tea_cache":
            return self.tea_cache_refusal()
        if self.cache_backend == "cache_dit":
            return self.cache_refusal(device_type)
        return None

    def tea_cache_refusal(self) -> str | None:
        """Why this engine cannot run TeaCache: it skips the whole block loop, so whatever needs every block to run
        in order (layerwise offload streaming, a whole-forward graph) cannot go with it. Sequence parallelism can:
        the ranks MAX-reduce each decision (gloo and NCCL both have MAX)."""
        if self.offload.streamed:
            return "layerwise offload (skipped blocks would break the streaming order); use module offload or none"
        if self.full_graph:
            return "diffusion_compile_granularity='full' (the cache swaps the block loop); use 'regional'"
        return None

    def cache_refusal(self, device_type: str | None = None) -> str | None:
        """Why this engine cannot run Cache-DiT's block cache (--cache-backend cache_dit, or a `quality=high`
        request); None when it can. `device_type` defaults to --device's (None for `auto`: the reasons that need no
        device)."""
        device_type = device_type or self.device_type
        if self.ulysses_degree * self.ring_degree > 1:
            return "sequence parallelism (each rank would judge the residual on its own rows); drop --usp/--ring"
        if self.offload.streamed:
            return "layerwise offload (skipped blocks would break the streaming order); use module offload or none"
        if self.full_graph:
            return "diffusion_compile_granularity='full' (the cache swaps the block loop); use 'regional'"
        if self.world_size > 1 and device_type == "cpu":
            return (
                "several CPU ranks (cache-dit averages the residual over the ranks with an AVG all-reduce, which "
                "gloo lacks)"
            )
        return None

    def dtype_name(self) -> str | None:
        """--dtype as a torch dtype's name; None for `auto` (the device's default). `ConfigError` when unknown."""
        if self.dtype == "auto":
            return None
        if self.dtype not in DTYPES:
            raise ConfigError(f"--dtype: unknown dtype {self.dtype!r}; choose from: auto, {', '.join(DTYPES)}")
        return self.dtype

    @property
    def full_graph(self) -> bool:
        """The whole forward is compiled (only when named: it is never a device's default)."""
        return not self.enforce_eager and self.compile_granularity == "full"

    def compile_mode(self, device_type: str) -> str | None:
        """The granularity the DiT is compiled at on a `device_type` device, or None for eager."""
        if self.enforce_eager:
            return None
        if self.compile_granularity is not None:
            return self.compile_granularity
        return "regional" if device_type == "cuda" else None

    def _validate_controlnet(self) -> None:
        """The combinations the control branch does not run in, refused with the reason."""
        path = self.controlnet_model_path
        if path is None:
            return
        flag = f"--controlnet-model-path {Path(path).name}"
        if not Path(path).is_file() or Path(path).suffix != ".safetensors":
            raise ConfigError(f"{flag}: not a .safetensors file")
        if "transformer" not in self.dits:
            raise ConfigError(f"{flag}: the control branch steers T2VA; load that DiT (--task-type fl2va or auto)")
        if self.ulysses_degree > 1 or self.ring_degree > 1:
            raise ConfigError(f"{flag}: the control branch runs on the whole packed sequence; not with --usp/--ring "
                              "(tensor parallelism works)")
        if self.offload.enabled:
            raise ConfigError(f"{flag}: the control blocks stay resident; not with DiT or component offload")
        if self.cache_backend != "none":
            raise ConfigError(f"{flag}: the hints enter between the DiT's blocks; not with --cache-backend")

    def _validate_fasth3_v2(self, layout: CheckpointLayout) -> None:
        """A FastH3 V2 tree's start-up contract (vLLM-Omni's): its base VAEs named, video sparse attention on, no
        top-k override, no LoRA or fused adapter (sequence parallelism: refused with VSA itself)."""
        flag = f"--model {self.model.name} ({fasth3_v2.NAME})"
        if self.base_checkpoint is None:
            try:
                layout.component("vae")
            except CheckpointError as e:
                raise ConfigError(f"{flag}: {e}") from None
        if not self.sparse_attention:
            raise ConfigError(f"{flag}: its DiT was distilled with video sparse attention (VIDEO_SPARSE_ATTN_H3); "
                              "start with --diffusion-attention-backend FASTVIDEO_VSA")
        if self.vsa_topk is not None:
            raise ConfigError(f"{flag}: its inference contract pins VSA sparsity {layout.contract.sparsity:g}; "
                              "drop --fastvideo-vsa-topk")
        if lora_enabled(self) or self.dit_adapter is not None:
            raise ConfigError(f"{flag}: a distilled checkpoint runs no LoRA; drop --lora-path/--lora-dir/--dit-adapter")

    def _validate_realtime(self) -> None:
        """What vLLM-Omni's TaoMate-H3 refuses (pure Ulysses, TP 1, the FL2VA DiT), and the adapter itself."""
        if self.realtime_lora is None:
            return
        flag = f"--realtime-lora {Path(self.realtime_lora).name}"
        if "transformer" not in self.dits:
            raise ConfigError(f"{flag}: real-time sessions run on the FL2VA (T2VA) DiT; load it (--task-type fl2va "
                              "or auto)")
        if self.tensor_parallel_size > 1:
            raise ConfigError(f"{flag}: real-time sessions run with pure Ulysses sequence parallelism (the LoRA is "
                              "replicated, the clean K/V cache sharded by heads); use --usp instead of -tp")
        if self.ring_degree > 1:
            raise ConfigError(f"{flag}: the clean K/V cache holds whole rows per head shard; use --usp, not --ring")
        if self.cache_backend != "none":
            raise ConfigError(f"{flag}: a real-time chunk runs three steps conditioned on cached K/V; a DiT block "
                              "cache does not apply (drop --cache-backend)")
        if self.full_graph:
            raise ConfigError(f"{flag}: the causal attention runs eagerly between compiled blocks; use "
                              "diffusion_compile_granularity='regional'")
        try:
            info = inspect_taomate(self.realtime_lora, dit_config(self.model, self.dits))
        except AdapterError as e:
            raise ConfigError(f"{flag}: {e}") from None
        if self.max_lora_rank is not None and self.max_lora_rank < info.rank:
            raise ConfigError(f"--max-lora-rank {self.max_lora_rank}: smaller than the real-time LoRA's rank "
                              f"{info.rank}")

    def _validate_lora(self) -> None:
        if self.dit_adapter is not None:
            if "transformer" not in self.dits:
                raise ConfigError("--dit-adapter: a FastH3 adapter serves T2VA; load that DiT (--task-type fl2va)")
            try:
                read_fasth3(self.dit_adapter)
            except AdapterError as e:
                raise ConfigError(f"--dit-adapter {self.dit_adapter}: {e}") from None
        self._validate_merge_lora()
        if not lora_enabled(self):
            return
        if self.max_cpu_loras < 1 or self.max_loras < 1:
            raise ConfigError("--max-cpu-loras and --max-loras must be >= 1")
        if self.max_lora_rank is not None and self.max_lora_rank < 1:
            raise ConfigError(f"--max-lora-rank must be >= 1, got {self.max_lora_rank}")
        if self.lora_dir is not None and not Path(self.lora_dir).is_dir():
            raise ConfigError(f"--lora-dir {self.lora_dir}: not a directory")
        try:
            catalog = catalog_for(self, log=lambda text: None)
        except AdapterError as e:
            raise ConfigError(str(e)) from None
        for name, choice in sorted(catalog.preloaded.items() if catalog is not None else ()):
            if choice.flashgen is not None:
                self._check_flashgen(name)

    def _check_flashgen(self, name: str) -> None:
        """A preloaded FlashGen LoRA: refused where vLLM-Omni refuses it (Ref2VA, a checkpoint or adapter that
        already pins a base schedule, model-level or layerwise DiT offload), and wherever h3serve cannot keep the
        AdaLN projections it trains resident."""
        flag = f"--lora-path {name}"
        if "transformer" not in self.dits:
            raise ConfigError(f"{flag}: a FlashGen LoRA adapts the FL2VA DiT (T2VA); Ref2VA is refused; load the "
                              "FL2VA DiT (--task-type fl2va or auto)")
        if self.dit_adapter is not None:
            raise ConfigError(f"{flag}: a FlashGen LoRA brings its own base schedule, and the fused FastH3 adapter "
                              "already pins one; drop one of them")
        dit_offloaded = (self.offload.staged_components() | self.offload.streamed_components()) & set(self.dits)
        if dit_offloaded or self.offload.adaln_on_host(self.adaln_memo_bytes is not None):
            raise ConfigError(f"{flag}: a FlashGen LoRA trains every block's AdaLN projection; model-level and "
                              "layerwise DiT offload are refused with it (as vLLM-Omni does), and so is any DiT "
                              "offload here (h3serve applies AdaLN factors to resident projections only)")

    @property
    def sparse_attention(self) -> bool:
        """The DiT blocks' attention core is video sparse attention (FASTVIDEO_VSA)."""
        roles = dict(self.attention_per_role)
        return roles.get("self", self.attention_backend) == "FASTVIDEO_VSA"

    def _validate_sparse_attention(self) -> None:
        """VSA runs on whole rows of one rank's heads: no sequence parallelism; its top-k only with it."""
        if self.vsa_topk is not None and (not self.sparse_attention or self.vsa_topk < 1):
            raise ConfigError(f"--fastvideo-vsa-topk {self.vsa_topk}: a positive tile count, with "
                              "--diffusion-attention-backend FASTVIDEO_VSA")
        if not self.sparse_attention:
            return
        if self.ulysses_degree * self.ring_degree > 1:
            raise ConfigError("--diffusion-attention-backend FASTVIDEO_VSA: video sparse attention runs on every row "
                              "of a rank's heads; not with --usp/--ring (tensor parallelism works)")
        if self.realtime_lora is not None:
            raise ConfigError("--diffusion-attention-backend FASTVIDEO_VSA: real-time sessions attend through their "
                              "K/V cache; not with --realtime-lora")

    def _validate_merge_lora(self) -> None:
        """--merge-lora: a dedicated server of one adapter, fused into the weights; what cannot go with it, refused
        with the reason."""
        if not self.merge_lora:
            return
        if len(self.lora_paths) != 1 or self.lora_dir is not None:
            given = f"{len(self.lora_paths)} --lora-path" + (" and --lora-dir" if self.lora_dir else "")
            raise ConfigError(f"--merge-lora fuses the server's one adapter into the weights: give exactly one "
                              f"--lora-path and no --lora-dir (got {given}); a server that switches adapters per "
                              "request runs them unmerged")
        (name, path), flag = self.lora_paths[0], "--merge-lora"
        if self.dit_adapter is not None:
            raise ConfigError(f"{flag}: this server already fuses the FastH3 adapter {Path(self.dit_adapter).name}; "
                              "fuse one adapter at most")
        if self.realtime_lora is not None:
            raise ConfigError(f"{flag}: real-time sessions run the base DiT beside their streaming LoRA "
                              "(--realtime-lora); a merged adapter would change every session's weights")
        if is_taomate_dir(path):
            raise ConfigError(f"{flag} {name}: a TaoMate-H3 streaming LoRA serves real-time sessions "
                              "(--realtime-lora), unmerged")
        try:
            catalog = catalog_for(self, log=lambda text: None)
        except AdapterError as e:
            raise ConfigError(str(e)) from None
        if catalog is not None and catalog.preloaded[name].pdd is not None:
            raise ConfigError(f"{flag} {name}: a PDD adapter also swaps the DiT's output heads per step and trains "
                              "the AdaLN projections; it is served unmerged (drop --merge-lora)")

    def warmup_requests(self, defaults: ModelDefaults) -> list[GenerationRequest]:
        """The requests --warmup names, as a client would send them (checked against the checkpoint's rules by
        `validate`): the default shape or WIDTHxHEIGHTxFRAMES, T2VA, a fixed prompt, `WARMUP_STEPS` forwards (the
        engine's `defaults` may pin a schedule, which keeps its own count)."""
        requests = []
        merged = defaults.merged_lora
        pinned = defaults.pinned_schedule is not None or (merged is not None and (merged.turbo or merged.pdd))
        for shape in self.warmup:
            steps = None if pinned else WARMUP_STEPS
            if shape == WARMUP_DEFAULT:
                size: dict[str, int] = {}
            else:
                match = WARMUP_SHAPE.fullmatch(shape)
                if match is None:
                    raise ConfigError(f"--warmup {shape}: expected {WARMUP_DEFAULT}, off or WIDTHxHEIGHTxFRAMES "
                                      "such as 1344x768x124")
                width, height, frames = (int(g) for g in match.groups())
                size = {"width": width, "height": height, "num_frames": frames}
            requests.append(GenerationRequest(prompt=WARMUP_PROMPT, steps=steps, seed=0, **size))
        return requests

    def _validate_warmup(self) -> None:
        """Every --warmup shape is a request this checkpoint serves (a bad one is refused before a weight is read)."""
        if not self.warmup:
            return
        defaults = engine_defaults(self, read_layout(self.model, self.dits).defaults())
        if "transformer" not in self.dits:
            raise ConfigError("--warmup runs T2VA requests, on the FL2VA DiT; this engine loads only the Ref2VA DiT "
                              "(--task-type ref2va): use --warmup off")
        for shape, request in zip(self.warmup, self.warmup_requests(defaults), strict=True):
            try:
                validate(request, defaults)
            except RequestError as e:
                raise ConfigError(f"--warmup {shape}: {e}") from None

    def validate(self) -> EngineConfig:
        """Fail loudly, at start-up, on any illegal value (the torch-free checks; the rank runs the others)."""
        self._validate_device()
        self._validate_sparse_attention()
        self._validate_processes()
        self._validate_compile_and_cache()
        self._validate_model()
        self._validate_lora()
        self._validate_controlnet()
        self._validate_realtime()
        self._validate_warmup()
        return self

    def _validate_device(self) -> None:
        if not DEVICE.fullmatch(self.device):
            raise ConfigError(f"--device: unknown device {self.device!r}; choose from: auto, cpu, cuda, cuda:N")
        if self.device.startswith("cuda:") and self.world_size * self.data_parallel_size > 1:
            # each rank takes its own GPU by local rank
            raise ConfigError(
                f"--device {self.device} names one GPU, but this engine runs "
                f"{self.world_size * self.data_parallel_size} ranks (one GPU each, by local rank); use --device cuda "
                "and choose the GPUs with CUDA_VISIBLE_DEVICES"
            )
        self.dtype_name()
        if self.device_memory is not None and self.device_memory <= 0:
            raise ConfigError(f"--device-memory must be > 0, got {self.device_memory}")
        if self.prompt_cache_bytes is not None and self.prompt_cache_bytes <= 0:
            raise ConfigError(f"--prompt-cache must be a positive size (or 'off'), got {self.prompt_cache_bytes}")
        if self.threads < 0:
            raise ConfigError(f"--threads must be >= 0, got {self.threads}")
        chunk = self.denoise_chunk_rows
        if chunk not in (AUTO, None) and (not isinstance(chunk, int) or chunk < MIN_DENOISE_CHUNK_ROWS):
            raise ConfigError(f"--denoise-chunk-rows: must be >= {MIN_DENOISE_CHUNK_ROWS} rows (or 'auto', 'off'), "
                              f"got {chunk!r}")

    def _validate_processes(self) -> None:
        if self.task_type not in TASK_TYPES:
            raise ConfigError(f"--task-type: unknown {self.task_type!r}; choose from: {', '.join(TASK_TYPES)}")
        if self.qkv_layout not in (None, "interleaved", "stacked"):
            raise ConfigError(f"--qkv-layout: unknown {self.qkv_layout!r}; choose from: interleaved, stacked")
        if self.num_ranks < 0:
            raise ConfigError(
                f"--num-gpus must be >= 1 (or 0: the product of the parallel degrees), got {self.num_ranks}"
            )
        if self.data_parallel_size < 1:
            raise ConfigError(f"--data-parallel-size must be >= 1, got {self.data_parallel_size}")
        if self.init_timeout_s <= 0:
            raise ConfigError(f"--init-timeout must be > 0 seconds, got {self.init_timeout_s:g}")
        if self.collective_timeout_s is not None and self.collective_timeout_s <= 0:
            raise ConfigError(f"--collective-timeout must be > 0 seconds, got {self.collective_timeout_s:g}")
        if not 0 < self.idle_keepalive_s < (self.collective_timeout_s or float("inf")):
            raise ConfigError("idle_keepalive_s must be > 0 and shorter than collective_timeout_s")
        if not 1 <= self.max_output_batch <= limits.MAX_OUTPUTS_PER_PROMPT:
            raise ConfigError(
                f"--max-output-batch {self.max_output_batch}: must be between 1 and {limits.MAX_OUTPUTS_PER_PROMPT}"
            )
        if self.decode_mode not in DECODE_MODES:
            raise ConfigError(f"--decode-mode {self.decode_mode}: choose from: {', '.join(DECODE_MODES)}")

    def _validate_compile_and_cache(self) -> None:
        if self.compile_granularity not in (None, "regional", "full"):
            raise ConfigError(
                f"--diffusion-compile-granularity {self.compile_granularity}: choose from: regional, full"
            )
        if self.compile_backend not in COMPILE_BACKENDS:
            raise ConfigError(
                f"--diffusion-compile-backend {self.compile_backend}: choose from: {', '.join(COMPILE_BACKENDS)}"
            )
        if self.full_graph and (self.ulysses_degree * self.ring_degree > 1 or self.offload.enabled):
            raise ConfigError(
                "diffusion_compile_granularity='full' is incompatible with sequence parallelism and offload; "
                "use 'regional' compilation instead"
            )
        if self.cache_backend not in CACHE_BACKENDS:
            raise ConfigError(f"--cache-backend {self.cache_backend}: choose from: {', '.join(CACHE_BACKENDS)}")
        if self.cache_backend == "cache_dit":
            require("cache", "--cache-backend cache_dit")
        self.cache_profile()
        refusal = self.backend_refusal()
        if refusal:
            raise ConfigError(f"--cache-backend {self.cache_backend} is not available with {refusal}")
        if self.cache_backend == "tea_cache" and "transformer" not in self.dits:
            raise ConfigError(  # vLLM-Omni's refusal of a Ref2VA partition
                "--cache-backend tea_cache: TeaCache only supports the MiniMax-H3 FL2VA partition; Ref2VA TeaCache "
                "has not been calibrated (its coefficients were fitted on the FL2VA DiT); use --task-type fl2va or "
                "auto, or --cache-backend cache_dit"
            )

    def _validate_model(self) -> None:
        try:  # the one resolver (modular root, native FL2VA/Ref2VA tree or variant folder): gaps named
            layout = read_layout(self.model, self.dits, base=self.base_checkpoint)
        except CheckpointError as e:
            raise ConfigError(f"--model: {e}") from None
        if layout.contract is not None:
            self._validate_fasth3_v2(layout)
        dims = read_model_dims(self.model, self.dits)
        check_degrees(self.parallel_degrees(), dims, self.cfg_parallel_size, self.vae_parallel_mode)
        if isinstance(self.offload.resident_layers, int) and self.offload.resident_layers:
            try:
                check_resident_layers(self.offload.resident_layers, dims.dit_layers)
            except OffloadError as e:
                raise ConfigError(str(e)) from None
        if self.offload.adaln and self.adaln_memo_bytes is None:
            raise ConfigError(
                '"adaln" in --diffusion-offload-config keeps the AdaLN projections off the device, which needs the '
                "AdaLN memo (modulations computed once per request); drop --adaln-memo off"
            )
        if self.adaln_cache_dir is not None and self.adaln_memo_bytes is None:
            raise ConfigError("--adaln-cache-dir fills the AdaLN memo, which --adaln-memo off turns off; drop one")
