"""The planner's runtime overhead: per-process CUDA context, one NCCL communicator per process group, the compile
workspace, the allocator's reserve; kept apart from the tensor bytes that the allocator's peak is checked against."""

from __future__ import annotations

import pytest

from h3serve.offload import overhead
from h3serve.offload.measured_engine import VLLM_OMNI, communicators
from h3serve.offload.overhead import runtime_overhead
from h3serve.offload.placement_plan import GiB
from h3serve.parallel import setup
from h3serve.parallel.degrees import ParallelDegrees

LAYOUTS = [
    ParallelDegrees(),
    ParallelDegrees(tensor_parallel=2, text_encoder_tp=2, vae_patch_parallel=2, world_size=2),
    ParallelDegrees(ulysses=4, world_size=4),
    ParallelDegrees(ulysses=4, text_encoder_tp=4, world_size=4),
    ParallelDegrees(tensor_parallel=2, ulysses=2, text_encoder_tp=4, vae_patch_parallel=4, world_size=4),
    ParallelDegrees(tensor_parallel=2, ulysses=2, ring=2, text_encoder_tp=2, world_size=8),
    ParallelDegrees(tensor_parallel=2, text_encoder_tp=4, world_size=4),  # 2 replicas of TP2
]


class _Recorder:
    """Stands in for torch.distributed inside RankParallel.build: records every group it is asked to create."""

    class group:  # noqa: N801 (the attribute torch.distributed has)
        WORLD = "world"

    def __init__(self, world: int):
        self.world, self.created = world, []

    def get_world_size(self, group=None) -> int:
        return self.world

    def new_group(self, ranks):
        self.created.append(tuple(ranks))
        return tuple(ranks)


@pytest.mark.parametrize("degrees", LAYOUTS, ids=str)
def test_communicators_are_the_groups_the_layout_creates(monkeypatch, degrees):
    recorder = _Recorder(degrees.world_size)
    monkeypatch.setattr(setup, "dist", recorder)
    monkeypatch.setattr(setup, "SequenceParallel", lambda *groups: groups)
    monkeypatch.setattr(setup, "TensorParallel", lambda *args: args)
    for rank in range(degrees.world_size):
        recorder.created.clear()
        setup.RankParallel.build(degrees, rank)
        joined = [g for g in recorder.created if rank in g and len(g) > 1]
        world = 1 if degrees.world_size > 1 else 0  # the default group, from init_process_group
        assert len(degrees.communicators(rank)) == len(joined) + world


def test_communicator_count_per_layout():
    quartet = ParallelDegrees(tensor_parallel=2, ulysses=2, text_encoder_tp=4, vae_patch_parallel=4, world_size=4)
    assert quartet.communicators(0) == ("world", "tp", "ulysses", "text_encoder")  # the Ulysses group is the sp one
    two = ParallelDegrees(tensor_parallel=2, text_encoder_tp=2, vae_patch_parallel=2, world_size=2)
    assert two.communicators(1) == ("world", "tp", "text_encoder")
    usp4 = ParallelDegrees(ulysses=4, world_size=4)  # the whole encoder on rank 0: no encoder group
    assert usp4.communicators(3) == ("world", "ulysses")
    hybrid = ParallelDegrees(ulysses=2, ring=2, world_size=4)  # both axes: the sequence group is its own
    assert hybrid.communicators(0) == ("world", "ulysses", "ring", "sp")
    replicas = ParallelDegrees(tensor_parallel=2, text_encoder_tp=2, world_size=4)
    assert replicas.communicators(1) == ("world", "tp", "text_encoder")
    assert replicas.communicators(3) == ("world", "tp")  # the second replica holds no encoder shard
    assert ParallelDegrees().communicators(0) == ()


def test_overhead_terms():
    quartet = ParallelDegrees(tensor_parallel=2, ulysses=2, text_encoder_tp=4, vae_patch_parallel=4, world_size=4)
    joined = len(quartet.communicators(0))  # world, tp, ulysses (the sequence group too), text encoder
    terms = runtime_overhead("cuda", joined, compiled=True, transient=3 * GiB, retained=GiB)
    assert terms == {
        "cuda_context": overhead.CUDA_CONTEXT,
        "nccl": 4 * overhead.NCCL_PER_COMMUNICATOR,
        "compile": overhead.COMPILE_WORKSPACE,
        "allocator_reserve": overhead.ALLOCATOR_BASE + int(0.10 * 3 * GiB),
        "retained_cache": GiB,
    }
    # Outside the allocator: context + compile + the communicators, calibrated on the PRO 5000 measurement's
    # 69,219 - 66,780 MiB (nvidia-smi less the allocator's reserved peak). vLLM-Omni's layout made five: its
    # sequence group apart from its Ulysses group, where h3serve's sequence group is the Ulysses group itself.
    vllm = len(communicators(VLLM_OMNI, quartet, 0))
    assert vllm == 5
    outside = terms["cuda_context"] + vllm * overhead.NCCL_PER_COMMUNICATOR + terms["compile"]
    assert outside == pytest.approx((69_219 - 66_780) * 2**20, rel=0.05)
    eager_one_gpu = runtime_overhead("cuda", 0, compiled=False, transient=0)
    assert eager_one_gpu == {"cuda_context": overhead.CUDA_CONTEXT, "allocator_reserve": overhead.ALLOCATOR_BASE}
    assert runtime_overhead("cpu", joined, compiled=True, transient=GiB) == {}
