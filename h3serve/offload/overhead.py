"""Runtime overhead: what an `nvidia-smi` sample of a rank holds besides the tensors the planner counts.

The planner's tensor terms (weights, stream buffers, modulations, activations) are what the caching allocator
hands out, so they are checkable against `torch.cuda.max_memory_allocated`. A GPU's used memory as nvidia-smi
reports it has four more terms, each a stated constant or rule below, per rank process and the same in every
stage except the allocator's. None of them was measured by this project (no GPU was lent to it); the sources
and the one calibration point are stated with each, and `docs/memory.md` compares the sum with the model card's
nvidia-smi figures.

  cuda_context       per process: the CUDA context with lazy module loading (CUDA 12+, torch's default) plus
                     the cuBLAS/cuBLASLt and cuDNN handles and the kernel images loaded on first use. 0.5 GiB: the
                     commonly observed 0.3-0.6 GiB of a PyTorch process on Hopper/Blackwell (an assumption).
  nccl               per NCCL communicator this rank belongs to: every process group of more than one rank the
                     parallel layout creates (h3serve.parallel.setup: the world group, then one group per
                     tensor-parallel, Ulysses and Ring axis of degree > 1, the sequence-parallel group when both
                     sequence axes are (with one, that axis' group is the sequence group), and
                     the text-encoder TP group on its first N ranks; `ParallelDegrees.communicators`). NCCL keeps
                     per channel and per connected peer a buffer for each protocol (NCCL_BUFFSIZE 4 MiB for
                     Simple, plus LL128 and LL) and the proxy's and p2p (all-to-all) staging buffers. 320 MiB a
                     communicator: calibrated on the one measurement that gives both an nvidia-smi figure and the
                     allocator's reserved peak (4 x RTX PRO 5000, TP2 x Ulysses 2, text-encoder TP4: 69,219 MiB
                     against 66,780 MiB, 2.38 GiB outside the allocator = context + compile + the 5 communicators
                     vLLM-Omni's layout made, h3serve.offload.measured_engine.communicators; h3serve's makes 4).
                     The planner's one constant calibrated on a measurement, the same for every layout.
  compile            when the DiT is compiled (torch.compile, the CUDA default unless --enforce-eager): the
                     Inductor/Triton kernel images loaded into the context and the autotuner's scratch.
                     0.25 GiB (an assumption).
  allocator_reserve  the caching allocator's reserved-but-unallocated memory: 0.25 GiB of kernel scratch and
                     segment rounding (allocations round up to 2 MiB multiples in 20 MiB+ segments), plus 10% of the
                     stage's transient bytes (activations, stream slots), which are freed and re-requested in other
                     sizes and leave cached blocks that the next sizes cannot reuse (an assumption).
  retained_cache     an earlier stage's freed blocks that the caching allocator still holds at this stage's peak
                     because none of this stage's requests fits in them: the denoise working set through vLLM-Omni's
                     whole-video decode (h3serve.offload.measured_engine, "retained cache"; only in plans made as
                     vLLM-Omni runs). h3serve's decode requests one clip at a time, each smaller than the denoise
                     blocks it is carved from, so its own plans have no such term.
On CPU there is no term: the rank's memory is its resident set, which the bench samples whole.
"""

from __future__ import annotations

from h3serve.offload.placement_plan import GiB

MiB = 2**20
CUDA_CONTEXT = GiB // 2
NCCL_PER_COMMUNICATOR = 320 * MiB
COMPILE_WORKSPACE = GiB // 4
ALLOCATOR_BASE = GiB // 4
ALLOCATOR_FRAGMENTATION = 0.10  # of a stage's transient bytes (activations and stream buffers)
TERMS = ("cuda_context", "nccl", "compile", "allocator_reserve", "retained_cache")
RESERVED_TERMS = ("allocator_reserve", "retained_cache")  # inside the allocator's reserved pool (max_memory_reserved)


def runtime_overhead(
    device_type: str, communicators: int, compiled: bool, transient: int, retained: int = 0
) -> dict[str, int]:
    """The overhead terms of one rank, in `communicators` NCCL communicators, in one stage whose transient tensors
    (activations, stream slots) are `transient` bytes and which still holds `retained` bytes of an earlier stage's
    freed blocks; empty on CPU. Terms that are zero are left out."""
    if device_type != "cuda":
        return {}
    terms = {
        "cuda_context": CUDA_CONTEXT,
        "nccl": NCCL_PER_COMMUNICATOR * communicators,
        "compile": COMPILE_WORKSPACE if compiled else 0,
        "allocator_reserve": ALLOCATOR_BASE + int(ALLOCATOR_FRAGMENTATION * transient),
        "retained_cache": retained,
    }
    return {name: n for name, n in terms.items() if n}
