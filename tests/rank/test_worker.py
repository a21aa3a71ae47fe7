"""Defect 10 of issue 29, on a CPU with torch.cuda and the process group faked: a single rank on `--device cuda:N`
makes GPU N its current device, and the per-step cancellation vote never waits for its own step's broadcast. And
what a rank reports when it fails."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from collective_devices import CollectiveDevices
from torch._subclasses.fake_tensor import FakeTensorMode

from h3serve.config.engine_config import EngineConfig
from h3serve.parallel.peers import Peers
from h3serve.rank import model_runner, worker
from h3serve.rank.device_checks import RankDevice
from h3serve.rank.worker import CancelVote, rank_gpu

CPU = torch.device("cpu")


def test_the_gpu_of_each_kind_of_rank():
    assert rank_gpu(torch.device("cuda", 3), rank=0, world=1, local_rank=None) == 3  # --device cuda:3
    assert rank_gpu(torch.device("cuda"), rank=0, world=1, local_rank=None) == 0
    assert rank_gpu(torch.device("cuda"), rank=2, world=4, local_rank=None) == 2  # one node, rank r on GPU r
    assert rank_gpu(torch.device("cuda"), rank=5, world=8, local_rank=1) == 1  # its node's GPU (or replica slice)
    assert rank_gpu(CPU, rank=1, world=2, local_rank=None) is None


def _set_devices(monkeypatch) -> list:
    chosen: list = []
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    return chosen


def test_a_single_rank_worker_on_cuda_n_sets_its_device_first(monkeypatch):
    chosen = _set_devices(monkeypatch)
    monkeypatch.setattr(worker, "check_engine", lambda config: RankDevice(torch.device("cuda", 2), torch.bfloat16, {}))

    def engine(config, rank, world_size, setup):
        assert chosen == [2], "the device must be current before the engine does any CUDA work"
        return SimpleNamespace(device=setup.device)

    monkeypatch.setattr(worker, "ModelRunner", engine)
    worker._start(0, 1, "unused://", EngineConfig(model="unused", device="cuda:2"), events=None, local_rank=None)
    assert chosen == [2]


class _Stop(Exception):
    pass


def test_an_in_process_engine_on_cuda_n_sets_its_device(monkeypatch, tiny_checkpoint):
    def set_device(device) -> None:
        raise _Stop(device)

    monkeypatch.setattr(torch.cuda, "set_device", set_device)
    device = RankDevice(torch.device("cuda", 1), torch.float32, {})
    monkeypatch.setattr(model_runner, "check_engine", lambda config: device)
    with pytest.raises(_Stop) as stopped:  # stopped there: the rest of the load would need the GPU
        model_runner.ModelRunner(EngineConfig(model=tiny_checkpoint, device="cuda:1", threads=1))
    assert torch.device(stopped.value.args[0]) == torch.device("cuda", 1)


@dataclass
class Flag:
    """The parent's shared cancel flag (a multiprocessing Value): the seq of the job to cancel."""

    value: int = 0


class TwoRanks:
    """Rank 0's and rank 1's votes run one after the other in this process; the fake broadcast hands rank 1 what
    rank 0 sent at the same step (the collective pairs the n-th broadcast of each rank)."""

    def __init__(self, monkeypatch, flag: Flag, seq: int):
        self.sent: list[torch.Tensor] = []
        self.received = 0
        self.me = 0
        monkeypatch.setattr(dist, "broadcast", self.broadcast)
        self.votes = [CancelVote(flag, seq, rank, 2, CPU) for rank in (0, 1)]

    def broadcast(self, tensor: torch.Tensor, src: int, group=None) -> None:
        assert src == 0 and tensor.device == CPU
        if self.me == 0:
            self.sent.append(tensor.clone())
        else:
            tensor.copy_(self.sent[self.received])
            self.received += 1

    def step(self) -> tuple[bool, bool]:
        decisions = []
        for rank, vote in enumerate(self.votes):
            self.me = rank
            decisions.append(vote())
        return decisions[0], decisions[1]


def test_every_rank_stops_at_the_step_after_rank_0_saw_the_flag(monkeypatch):
    flag = Flag()
    ranks = TwoRanks(monkeypatch, flag, seq=7)
    assert [ranks.step() for _ in range(3)] == [(False, False)] * 3
    flag.value = 7  # the parent asks during step 4
    assert ranks.step() == (False, False)  # step 4 broadcasts rank 0's decision, obeyed at step 5
    assert ranks.step() == (True, True)


def test_another_jobs_cancel_stops_nothing(monkeypatch):
    ranks = TwoRanks(monkeypatch, Flag(value=6), seq=7)
    assert [ranks.step() for _ in range(4)] == [(False, False)] * 4


def test_a_single_rank_obeys_the_flag_at_once_without_a_collective(monkeypatch):
    monkeypatch.setattr(dist, "broadcast", lambda *a, **k: pytest.fail("a single rank broadcasts nothing"))
    flag = Flag()
    vote = CancelVote(flag, 3, 0, 1, CPU)
    assert not vote()
    flag.value = 3
    assert vote()


class FakeEvent:
    """torch.cuda.Event, recording what the vote does with it."""

    log: list[str] = []

    def __init__(self, blocking: bool = False):
        assert blocking, "a blocking event: the wait sleeps instead of spinning a core"

    def record(self) -> None:
        FakeEvent.log.append("record")

    def synchronize(self) -> None:
        FakeEvent.log.append("synchronize")


def test_on_cuda_a_step_broadcasts_on_the_gpu_and_waits_only_for_the_previous_step(monkeypatch):
    """The old vote ran `.item()` on the step's own broadcast: the host waited for the device to finish the
    whole step every step. Now the step's broadcast (on the GPU: NCCL takes nothing else) is copied to the host
    behind an event, and only the next step waits on that event."""
    checker = CollectiveDevices("nccl").install(monkeypatch, current_gpu=1)
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    FakeEvent.log = []
    vote = CancelVote(Flag(value=5), 5, 0, 2, torch.device("cuda", 1))
    with FakeTensorMode(allow_non_fake_inputs=True):
        vote._post(True)
    assert checker.calls == [("broadcast", "nccl", ("cuda",))]
    assert FakeEvent.log == ["record"]  # nothing waited for at the step that broadcast
    host, _ = vote.pending
    assert host.device == CPU
    vote.pending = (torch.ones(1, dtype=torch.int32), vote.pending[1])  # the copy's value (fakes hold no data)
    assert vote._collect() is True
    assert FakeEvent.log == ["record", "synchronize"] and vote.pending is None


def test_a_rank_that_lost_a_peer_names_it_other_failures_stay_summarised():
    peers = Peers(("10.0.0.1", "10.0.0.2"))
    reset = RuntimeError("[third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [10.0.0.2]:28388: "
                         "Connection reset by peer")
    lost = worker._failed(7, reset, 0, prefix="rank 0: ", peers=peers)
    assert (lost.seq, lost.rank, lost.client_error, lost.code) == (7, 0, False, "internal_error")
    assert lost.message == ("rank 0 lost its connection to rank 1 (node 1): its process or node died, or the network "
                            "failed")
    other = worker._failed(7, RuntimeError("shape mismatch"), 0, prefix="rank 0: ", peers=peers)
    assert other.message == "rank 0: internal error during generation (RuntimeError); see the server log"
