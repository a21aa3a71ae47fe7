"""EngineConfig: every engine flag, as a frozen value.

A leaf: it reads no file and imports nothing of h3serve but its errors, so every room can take an `EngineConfig`.
What it means below the engine each room says itself (`ParallelDegrees.of`, `accel.cache_profile.server_cache_profile`,
`GuideLimits.from_flag`). The torch-free start-up checks against the checkpoint and its adapters are
`h3serve.config_checks.check_config`; what only torch can tell (which device `auto` is, whether a GPU or a kernel is
there) each rank checks before it reads a weight (`h3serve.rank.device_checks`), with the same `ConfigError` messages.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from h3serve.config.offload_config import AUTO, DenoiseChunk, OffloadConfig
from h3serve.config.quantization_config import QuantizationConfig
from h3serve.errors import ConfigError

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
    """--warmup: "off" -> none; "default" and WIDTHxHEIGHTxFRAMES shapes, comma-separated (checked by `check_config`);
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
    # Multi-rank execution (h3serve.parallel); checked against the checkpoint's shapes by `check_config`.
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
    timeline_guide_limits: str = ""  # --timeline-guide-limits JSON object: GuideLimits overrides (rules/guides.py)
    init_timeout_s: float = 600.0  # --init-timeout: seconds the ranks may take to load
    idle_keepalive_s: float = 60.0  # idle multi-rank engines exchange a keepalive this often (under the PG timeout)
    collective_timeout_s: float | None = None  # --collective-timeout (process group); None: torch's (gloo 30 min)
    offload: OffloadConfig = field(default_factory=OffloadConfig)  # staged / streamed components (h3serve.offload)
    decode_mode: str = "stream"  # stream: VAE clips into the MP4 as they are decoded | full: whole arrays first
    # Several outputs of one prompt denoise as one batch of up to this many (h3serve.model.pipeline); 1: one at a
    # time, each exactly its single request on any device. The default is 4.
    max_output_batch: int = 4
    device_memory: int | None = None  # --device-memory: bytes per device for the plan's verdict; None: ask the GPU
    quantization: QuantizationConfig | None = None  # --quantization fp8 (config.quantization_config); None: full
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

    @property
    def server_cache(self) -> str | None:
        """--cache-backend as the request rules see it: the cache a request that omits `quality` runs under."""
        return None if self.cache_backend == "none" else self.cache_backend

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

    @property
    def sparse_attention(self) -> bool:
        """The DiT blocks' attention core is video sparse attention (FASTVIDEO_VSA)."""
        roles = dict(self.attention_per_role)
        return roles.get("self", self.attention_backend) == "FASTVIDEO_VSA"
