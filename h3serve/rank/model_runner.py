"""In-process engine: one pipeline on this process' device; requests run one at a time in the calling thread.

The executor runs one of these in every rank process; tests and tools may use it directly.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Callable

import torch

from h3serve.accel import attention
from h3serve.accel.cache import DitBlockCache
from h3serve.accel.cache_profile import cache_refusal, server_cache_profile
from h3serve.accel.compile import CompileState, compile_transformer
from h3serve.accel.video_sparse import SparseSettings
from h3serve.adapters.serving import catalog_for, engine_defaults, merged_edits
from h3serve.checkpoint.resolver import read_layout
from h3serve.config.engine_config import EngineConfig
from h3serve.config_checks import check_config
from h3serve.engine.planning import check_task_served, plan_request
from h3serve.errors import ConfigError
from h3serve.loading.adaln_sidecar import load_sidecars
from h3serve.loading.components import load_components
from h3serve.loading.controlnet_weights import read_controlnet
from h3serve.loading.dit_pieces import BlockPieces
from h3serve.loading.quantize_on_load import resolve_kernel
from h3serve.messages import GenerationOutput
from h3serve.model.adaln_memo import AdaLNMemo, plain_host_copy
from h3serve.model.pipeline import H3Pipeline
from h3serve.model.pipeline_types import FrameSink, GenerationResult, H3Components, StepCallback
from h3serve.model.prompt_cache import PromptCache
from h3serve.offload.host_arena import pinned_copy
from h3serve.offload.pieces import PieceSources
from h3serve.offload.runtime import OffloadRuntime
from h3serve.parallel.degrees import ParallelDegrees
from h3serve.parallel.setup import RankParallel
from h3serve.rank.device_checks import RankDevice, check_engine, cpu_threads, start_up_notices
from h3serve.rank.lora import lora_runtime
from h3serve.rank.media_conditioning import load_conditioning
from h3serve.rank.memory import PeakMemory
from h3serve.rank.placement import (
    device_memory_of,
    long_request_refusal,
    lora_adaln,
    output_batch,
    placement_for_engine,
)
from h3serve.rules.adapter_choice import merged_choice
from h3serve.rules.guide_limits import GuideLimits
from h3serve.rules.guides import attention_refusal
from h3serve.rules.request import GenerationRequest
from h3serve.rules.validate import GenerationPlan, ModelDefaults, RequestError


class ModelRunner:
    """Loads the checkpoint once, then validates and runs requests."""

    def __init__(self, config: EngineConfig, rank: int = 0, world_size: int = 1, setup: RankDevice | None = None):
        """`setup`: the rank's start-up check, when its caller ran it already (the worker does, first thing)."""
        self.config = check_config(config)
        setup = setup or check_engine(config)  # what only torch can check: the device, its kernels
        self.rank, self.world_size = rank, world_size
        self.layout = read_layout(config.model, config.dits, base=config.base_checkpoint)
        # A fused FastH3 adapter pins its schedule; a merged LoRA (--merge-lora) runs in every request.
        self.defaults = engine_defaults(config, self.layout.defaults())
        self.defaults = dataclasses.replace(self.defaults, server_cache=config.server_cache)
        self.defaults = guide_serving(self.config, self.defaults, setup.attention.get("self"))
        self.device = setup.device
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())  # a rank's GPU (set by the worker)
        elif self.device.type == "cuda":  # --device cuda:N in this process (no worker set it): no context on GPU 0
            torch.cuda.set_device(self.device)
        if rank == 0:
            for line in start_up_notices(config, self.device):  # what `auto` turned out to mean
                print(line, file=sys.stderr)
        threads = cpu_threads(config, self.device)
        if threads:
            torch.set_num_threads(threads)
        # The placement plan comes first: a configuration that cannot fit is refused before a weight is read.
        log = (lambda text: print(text, file=sys.stderr)) if rank == 0 else None
        config, self.placement = placement_for_engine(self.config, self.device, log)
        self.config = config
        start = time.perf_counter()
        components = self._load(setup, log)
        self._compile(components)
        self.load_seconds = time.perf_counter() - start
        self.tasks = components.tasks
        # On a GPU the memo's host store holds each entry in one pinned arena of exactly its bytes (the planner's
        # host figure), copied from the device with one wait; on CPU plain tensors.
        host_copy = pinned_copy if self.device.type == "cuda" else plain_host_copy
        memo = None if config.adaln_memo_bytes is None else AdaLNMemo(config.adaln_memo_bytes, host_copy)
        sequence = self.parallel.sequence if self.parallel is not None else None
        cache = DitBlockCache(server_cache_profile(config), components.transformer, sequence and sequence.sp_group)
        if config.prompt_cache_bytes is not None:  # repeated prompts skip the text encoder (the planner counts it)
            components.text.cache = PromptCache(config.prompt_cache_bytes, host_copy)
        self.pipeline = H3Pipeline(
            components, self.device, hooks=self.offload, cache=cache, adaln=memo, output_batch=config.max_output_batch,
        )
        self.sidecars: dict[str, str] = {}  # DiT -> "hit" | "missing" | why its sidecar was refused
        if memo is not None and config.adaln_cache_dir is not None:
            self.sidecars = load_sidecars(
                self.pipeline, memo, config.adaln_cache_dir, self.defaults, rank, world_size,
                lambda text: print(f"rank {rank}: {text}", file=sys.stderr),
            )  # fmt: skip
        # quality=high installs the block cache per request even without --cache-backend: same limits apply.
        self.cache_refusal = cache_refusal(config, self.device.type)

    def _load(self, setup: RankDevice, log: Callable[[str], None] | None) -> H3Components:
        """The weights on this rank, then in order: Q/K/V fusion and attention kernels, LoRA wrappers, the
        parallel hooks and the offload placement."""
        config, rank = self.config, self.rank
        # Multi-rank: this rank's process groups, shard loading and parallel hooks (h3serve.parallel).
        self.parallel = RankParallel.build(ParallelDegrees.of(config), rank) if self.world_size > 1 else None
        offload = config.offload
        on_host = offload.staged_components() | offload.streamed_components()
        kernel = resolve_kernel(config.quantization, self.device, setup.dtype, log)  # FP8: the path, logged once
        adaln_host = offload.adaln_on_host(config.adaln_memo_bytes is not None)
        # DLO all-gather: the DiTs' streamed blocks are read by the offload units, each rank only its piece.
        sequence = self.parallel is not None and self.parallel.sequence is not None
        sources = PieceSources() if offload.gathers("transformer", sequence) else None
        components = load_components(
            self.layout, setup.dtype, self.device, config.dits, parallel=self.parallel, on_host=on_host,
            quantization=config.quantization, kernel=kernel, dit_adapter=config.dit_adapter,
            qkv_layout=config.qkv_layout, pieces=None if sources is None else BlockPieces(sources, adaln_host),
            merged_lora=merged_edits(config),
        )
        roles = setup.attention
        contract = self.layout.contract  # a FastH3 V2 checkpoint pins its VSA sparsity
        sparse = SparseSettings(contract.sparsity) if contract is not None else SparseSettings(topk=config.vsa_topk)
        for dit in (components.transformer, components.transformer_ref):
            if dit is not None:  # before the parallel hooks: sequence parallelism replaces the blocks' core
                dit.fuse_projections()  # one Q/K/V GEMM per attention (exact), before offload lays out weights
                try:
                    attention.install(dit, roles, sparse)
                except attention.AttentionBackendError as e:
                    raise ConfigError(str(e)) from None
                for block in dit.transformer_blocks:  # the planner's row chunk (resolved at start-up)
                    block.row_chunk = config.denoise_chunk_rows
        # Per-request LoRA: wrappers on the target layers (after Q/K/V fusion, before compile; h3serve.rank.lora);
        # the AdaLN projections too where a PDD adapter may come and they stay resident (the planner counts it).
        tp = self.parallel.dit_tp if self.parallel else None
        catalog = catalog_for(config, log=lambda text: None)
        self.lora = lora_runtime(config, catalog, components, tp, self.device, adaln=lora_adaln(config, catalog))
        if self.parallel is not None:
            self.parallel.install(components, attention.BACKENDS[roles["self"]])
        if config.controlnet_model_path is not None and components.transformer is not None:
            # Beside the T2VA DiT, whole on every rank (after the parallel hooks: never cut, never sharded; under
            # tensor parallelism each rank runs the whole branch on the replicated residual stream).
            dit = components.transformer
            dit.controlnet = read_controlnet(config.controlnet_model_path, dit.config, self.device, setup.dtype)
        # Placement (h3serve.offload): staged components and streamed blocks move to the device when used.
        gather_group = self.parallel.sequence.sp_group if self.parallel and self.parallel.sequence else None
        keep = self.lora.scales() if self.lora is not None else ()
        overlap = self.parallel is not None and self.parallel.one_denoise_communicator
        self.offload = OffloadRuntime(
            components, offload, self.device, gather_group, adaln_host, keep, overlap_gather=overlap, sources=sources
        )
        if self.lora is not None:  # an offloaded DiT's factors are tensors of its blocks: they stream with them
            self.lora.attach_offload(self.offload)
        return components

    def _compile(self, components: H3Components) -> None:
        """After the parallel and offload hooks: compile wraps each block's forward, the hooks stay outside."""
        mode = self.config.compile_mode(self.device.type)
        if mode is None:
            return
        state = CompileState(log=lambda text: print(text, file=sys.stderr) if self.rank == 0 else None)
        for dit in (components.transformer, components.transformer_ref):
            if dit is not None:
                compile_transformer(dit, mode, self.config.compile_dynamic, state, backend=self.config.compile_backend)

    def plan(self, request: GenerationRequest) -> GenerationPlan:
        """Validate a request (and its media) against this checkpoint. Raises client errors."""
        plan = plan_request(request, self.defaults, self.tasks)
        if plan.quality == "high" and self.cache_refusal:
            why = f"quality=high (a DiT block cache) is not available with {self.cache_refusal}"
            raise RequestError("quality", why)
        return plan

    def generate(
        self, plan: GenerationPlan, on_progress: StepCallback | None = None, sink: FrameSink | None = None
    ) -> GenerationOutput:
        """Run one plan; `on_progress(done, total)` after every denoise step (the executor's signature too).
        With a `sink` the video is streamed into it (h3serve.media.sink) and the output holds no frames. A plan of
        several outputs returns output 0 with the others in `output.others` (streamed into `sink.for_output(i)`).

        A long video request, or one that encodes a source video, is first put to the memory planner (its longest
        pass on this device): one that cannot fit is refused as the client's error before anything runs."""
        check_task_served(plan.task, self.tasks)
        controlnet = self.pipeline.components.transformer.controlnet if self.pipeline.components.transformer else None
        if plan.control is not None and controlnet is None:
            raise RequestError(f"extra_params.{plan.control.type}",
                               "this server serves no ControlNet (start it with --controlnet-model-path)")
        refusal = long_request_refusal(self.config, plan, device_memory_of(self.config, self.device))
        if refusal is not None:
            field = ("long_video_mode" if plan.long_video_mode is not None else "timeline_guides" if plan.guides
                     else "video")
            raise RequestError(field, f"this server cannot run the request: {refusal}")
        if self.lora is not None:
            self.lora.activate_for(plan)
        elif self.defaults.merged_lora is not None:  # in the weights: another adapter or scale is refused
            merged_choice(self.defaults.merged_lora, plan.lora, plan.task)
        elif plan.lora is not None:
            raise RequestError("lora", "this server serves no LoRA adapters")
        with PeakMemory(self.device) as memory:
            start = time.monotonic()
            conditioning = load_conditioning(plan, self.defaults)
            loaded = time.monotonic()
            batch = output_batch(self.config, plan, device_memory_of(self.config, self.device))
            result = self.pipeline.generate(plan, conditioning, on_progress, sink, output_batch=batch)
        if result.block_cache is not None and self.rank == 0:
            cache = result.block_cache
            print(
                f"block cache: {cache.skipped} of {cache.evaluated + cache.skipped} DiT block evaluations skipped "
                f"({cache.cached_steps} cached steps)",
                file=sys.stderr,
            )
        if plan.task != "t2va" or plan.guides:
            result.stage_durations = {"media_load": loaded - start, **result.stage_durations}
            result.stage_timeline = [("media_load", start, loaded), *result.stage_timeline]
        output = _media(result)
        output.stage_durations, output.peak_memory_mb = result.stage_durations, memory.mb
        output.stage_timeline = sorted(result.stage_timeline, key=lambda span: span[1])
        output.counters = self.counters()
        output.others = [_media(other) for other in result.others]
        return output

    def counters(self) -> dict[str, int]:
        """Since this engine loaded: LoRA adapter loads into host memory and for the device (switching between
        cached adapters adds none), the torch.compile graphs built in this process (a recompile adds one), and the
        prompt cache's hits and misses."""
        loads = self.lora.loads if self.lora is not None else {"host": 0, "device": 0}
        compiled = self.config.compile_mode(self.device.type) is not None  # eager: Dynamo is never imported
        graphs = int(torch._dynamo.utils.counters["stats"]["unique_graphs"]) if compiled else 0
        cache = self.pipeline.components.text.cache
        return {"lora_host_loads": loads["host"], "lora_device_loads": loads["device"], "compiled_graphs": graphs,
                "prompt_cache_hits": cache.hits if cache else 0, "prompt_cache_misses": cache.misses if cache else 0}


def guide_serving(config: EngineConfig, defaults: ModelDefaults, self_attention: str | None) -> ModelDefaults:
    """The defaults with this engine's timeline guide serving: its limits, and why it serves none (a self-attention
    backend that is not dense). The cache they refuse per request is the defaults' `server_cache`."""
    refusal = None if self_attention is None else attention_refusal(self_attention)
    limits = GuideLimits.from_flag(config.timeline_guide_limits)
    return dataclasses.replace(defaults, guide_limits=limits, guide_refusal=refusal)


def _media(result: GenerationResult) -> GenerationOutput:
    """One output's media as host arrays (none when streamed)."""
    return GenerationOutput(
        video=None if result.video is None else result.video.numpy(),
        audio=result.audio.numpy(),
        streamed_frames=result.num_frames if result.video is None else 0,
    )
