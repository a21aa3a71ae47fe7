"""PlacementPlan: per rank and per stage, the bytes on the compute device and in (pinned) host memory.

The one object that `h3serve plan`, the start-up check, `--dlo-resident-layers auto`, the offload hooks and the
bench read. Data only (no torch): the planner (`h3serve.offload.planner`) builds it from shapes, the hooks
(`h3serve.offload.runtime`) carry it out, and a test compares what the hooks did against it.

Accounting contract, per stage and component (checkpoint names: transformer, transformer_ref, text_encoder,
vae, audio_vae):
  weights[c]         bytes of c's weights that stay on the device for the whole stage: a whole component, or
                     for a streamed one its non-block parameters plus its resident blocks;
  stream_buffers[c]  bytes of the two device slots c's streamed blocks pass through (double buffering):
                     2 x its largest streamed block (this rank's TP shard; a whole block after an all-gather);
so the most of c that is ever on the device during the stage is weights[c] + stream_buffers[c].
AdaLN projections kept in host memory are the pseudo-component "adaln" (`ADALN`): one slot, filled block by block
while the request's modulations are computed at the start of denoise, before any DiT block streams; the
modulations themselves (`modulations`) stay on the device for the whole denoise stage.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

# Stages in the order a request runs them. vae_encode only runs for keyframes and references.
STAGES = ("text_encode", "vae_encode", "denoise", "video_decode", "audio_decode")
ADALN = "adaln"  # every DiT's AdaLN projections (blocks' adaln_proj, norm_out.linear) when kept in host memory
COMPONENTS = ("transformer", "transformer_ref", "text_encoder", "vae", "audio_vae", ADALN)
ADALN_MEMO = "adaln_memo"  # host bytes only: the memo's store of modulations (h3serve.model.adaln_memo)
CONTROL_MEDIA = "control_media"  # host bytes only: a ControlNet request's media on the canvas (rank.media_conditioning)
PROMPT_CACHE = "prompt_cache"  # host bytes only: the prompt cache's text states (h3serve.model.prompt_cache)
GiB = 2**30
TASK_DIT = {"t2va": "transformer", "fl2va": "transformer", "ref2va": "transformer_ref"}  # the DiT a task runs
MAIN_DIT = "transformer"  # the only DiT whose blocks may stay resident (vLLM-Omni's resident_dit_paths)
# The repeated blocks that stream, per component, as ModuleList paths in execution order (the vision tower runs
# before the language layers, and only for images and videos); the planner counts and the hooks move these.
DIT_GROUPS = ("token_refiner.refiner_blocks", "transformer_blocks")
TEXT_GROUPS = ("visual.blocks", "language_model.layers")
BLOCK_GROUPS = {"transformer": DIT_GROUPS, "transformer_ref": DIT_GROUPS, "text_encoder": TEXT_GROUPS}
RESIDENT_GROUP = "transformer_blocks"  # the group whose first K blocks may stay resident (main DiT only)


def stages_for(task: str, source: bool = False) -> tuple[str, ...]:
    """The stages a task runs: vae_encode only for keyframes (fl2va), references (ref2va) and an edit's or
    extension's source video (`source`)."""
    return tuple(s for s in STAGES if s != "vae_encode" or source or task in ("fl2va", "ref2va"))


def stage_components(stage: str, task: str) -> frozenset[str]:
    """The components a stage of a `task` request computes with (what a staged component is loaded for)."""
    if stage == "text_encode":
        return frozenset({"text_encoder"})
    if stage == "vae_encode":  # keyframes / reference images and videos; reference audio only in Ref2VA
        return frozenset({"vae", "audio_vae"} if task == "ref2va" else {"vae"})
    if stage == "denoise":
        return frozenset({TASK_DIT[task]})
    if stage == "video_decode":
        return frozenset({"vae"})
    if stage == "audio_decode":
        return frozenset({"audio_vae"})
    raise ValueError(f"unknown stage {stage!r}; stages: {', '.join(STAGES)}")


@dataclass(frozen=True)
class StagePlan:
    stage: str
    weights: Mapping[str, int]  # component -> resident weight bytes on the device during the stage
    stream_buffers: Mapping[str, int] = field(default_factory=dict)  # component -> bytes of its two block slots
    activations: int = 0  # estimated peak activation bytes of the stage
    modulations: int = 0  # the request's precomputed AdaLN modulations (h3serve.model.adaln_memo)
    # What an nvidia-smi sample holds besides the tensors, by named term (h3serve.offload.overhead): CUDA context,
    # NCCL communicators, compile workspace, the allocator's reserve. Empty on CPU.
    overhead: Mapping[str, int] = field(default_factory=dict)

    @property
    def weight_bytes(self) -> int:
        return sum(self.weights.values()) + sum(self.stream_buffers.values())

    @property
    def tensor_bytes(self) -> int:
        """The stage's tensor peak (what the caching allocator hands out, `max_memory_allocated`): the AdaLN slot
        is filled only before the blocks stream and their activations exist."""
        adaln = self.stream_buffers.get(ADALN, 0)
        steps = self.weight_bytes - adaln + self.activations
        return max(steps, self.weight_bytes - sum(self.stream_buffers.values()) + adaln) + self.modulations

    @property
    def overhead_bytes(self) -> int:
        return sum(self.overhead.values())

    @property
    def device_bytes(self) -> int:
        """The stage's peak as nvidia-smi would show it: tensors plus the runtime overhead."""
        return self.tensor_bytes + self.overhead_bytes

    def component_peak(self, component: str) -> int:
        """The most of `component` ever on the device during this stage (what a placement test observes)."""
        return self.weights.get(component, 0) + self.stream_buffers.get(component, 0)


@dataclass(frozen=True)
class RankPlan:
    rank: int
    stages: tuple[StagePlan, ...]
    # component -> bytes kept in (pinned) host memory for staging or streaming; "adaln_memo": the AdaLN memo's
    # store of modulations for later requests, up to its bound (`ADALN_MEMO`); "prompt_cache": the prompt cache's
    # text states, up to its bound (`PROMPT_CACHE`)
    host_bytes: Mapping[str, int]
    communicators: tuple[str, ...] = ()  # the process groups of > 1 rank it joins (one NCCL communicator each)

    def stage(self, name: str) -> StagePlan:
        for s in self.stages:
            if s.stage == name:
                return s
        raise KeyError(f"no stage {name!r} in the plan; stages: {', '.join(s.stage for s in self.stages)}")

    @property
    def peak_stage(self) -> str:
        return max(self.stages, key=lambda s: s.device_bytes).stage

    @property
    def peak_device_bytes(self) -> int:
        return max(s.device_bytes for s in self.stages)

    @property
    def peak_tensor_bytes(self) -> int:
        """The tensor part alone (against the allocator's peak); its stage may differ from `peak_stage`."""
        return max(s.tensor_bytes for s in self.stages)

    @property
    def total_host_bytes(self) -> int:
        return sum(self.host_bytes.values())


@dataclass(frozen=True)
class PlacementPlan:
    ranks: tuple[RankPlan, ...]
    resident_layers: int  # the resolved K (after "auto")
    device_memory: int | None = None  # bytes per device; None: unknown (no verdict)
    headroom: int = 0  # bytes kept free on top of the peak for a "fits" verdict
    notes: tuple[str, ...] = ()  # assumptions stated with the plan (request shape, estimates used)
    denoise_chunk_rows: int | None = None  # the resolved row chunk of the denoise blocks (None: whole)

    @property
    def peak_device_bytes(self) -> int:
        return max(r.peak_device_bytes for r in self.ranks)

    @property
    def peak_tensor_bytes(self) -> int:
        return max(r.peak_tensor_bytes for r in self.ranks)

    @property
    def fits(self) -> bool | None:
        if self.device_memory is None:
            return None
        return self.peak_device_bytes + self.headroom <= self.device_memory

    @property
    def shortfall_bytes(self) -> int:
        """How much more device memory the worst rank needs (0 when it fits or the device is unknown)."""
        if self.device_memory is None:
            return 0
        return max(0, self.peak_device_bytes + self.headroom - self.device_memory)
