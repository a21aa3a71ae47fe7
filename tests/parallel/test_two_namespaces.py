"""Two nodes on real sockets: two network namespaces joined by a veth pair stand in for two machines.

Two sessions, each a pair of node processes started in the namespaces the way docs/scaling.md tells users to:
- torchrun: the same `torchrun --nnodes 2 --node-rank K --master-addr A -m h3serve generate ... -tp 2` on
  both nodes. Node 0 writes the output, bit-identical to TP2 on one node (TP2 itself differs from one rank in the
  last bits, as TP's partial sums are added in another order: that is held to the multi-rank tolerance).
- the by-hand variables NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT: node 1 runs `h3serve serve` (a follower
  node: it only hosts rank 1), node 0 the leader's Executor (namespace_leader.py, as `h3serve serve` starts it).
  A U2 request is bit-identical to one rank. Node 1's rank is killed in the middle of a request: node 0 fails it
  naming rank 1, both nodes start their ranks again and the next request is bit-identical again. Then the whole
  of node 1 is killed (SIGKILL to its process group) in the middle of a request, and node 0 must fail that
  request naming rank 1 and node 1 within --collective-timeout.
Neither sets GLOO_SOCKET_IFNAME: the ranks use the interface that routes to MASTER_ADDR (gloo's own default, the
address the host name resolves to, is 127.0.0.1 on this kind of host, which the other node cannot reach).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import psutil
import pytest
import torch
from rank_plans import DURATION_S, PROMPT, SEED, STEPS, plan_for
from two_namespaces import JsonLines, NamespacesUnavailable, TwoNodes, log_tail

from h3serve.config.engine_config import EngineConfig
from h3serve.engine.executor import Executor
from h3serve.media.raw import read_raw
from h3serve.rank.model_runner import ModelRunner

pytestmark = pytest.mark.slow

LEADER = Path(__file__).with_name("namespace_leader.py")
NODE_FLAGS = ["--device", "cpu", "--threads", "1", "--task-type", "fl2va", "--num-gpus", "2"]
COLLECTIVE_TIMEOUT_S = 30.0  # --collective-timeout of the second session: the bound on noticing a lost node
MARGIN_S = 10.0  # scheduling on a loaded 2-core host, on top of that bound
START_S = 180.0  # two nodes loading (imports, weights) on a loaded host
TOLERANCE = 1e-4  # test_multirank.py's: a layout against one rank, where the bits may differ


@pytest.fixture(scope="module")
def nodes():
    try:
        pair = TwoNodes.create(str(os.getpid()))
    except NamespacesUnavailable as e:
        pytest.skip(f"{e}: needs root (CAP_NET_ADMIN) and iproute2, as CI has")
    try:
        yield pair
    finally:
        pair.remove()


def _node_env(**variables: str) -> dict[str, str]:
    """This process' environment (PYTHONPATH, the rank start method) without any interface or launcher choice."""
    env = {k: v for k, v in os.environ.items() if k not in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "NNODES",
                                                             "NODE_RANK", "MASTER_ADDR", "MASTER_PORT")}
    return {**env, "PYTHONUNBUFFERED": "1", **variables}


@pytest.fixture(scope="module")
def one_rank(parallel_checkpoint):
    threads = torch.get_num_threads()
    try:
        engine = ModelRunner(EngineConfig(model=parallel_checkpoint, threads=1, task_type="fl2va"))
        return engine.generate(plan_for(engine.defaults)).outputs[0]
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tp2_one_node(parallel_checkpoint):
    executor = Executor(EngineConfig(model=parallel_checkpoint, threads=1, task_type="fl2va", tensor_parallel_size=2))
    try:
        return executor.generate(plan_for(executor.defaults))
    finally:
        executor.close()


@dataclass
class TorchrunRun:
    codes: list[int | None]  # node 0, node 1
    folder: Path

    def logs(self) -> str:
        return "\n".join(log_tail(self.folder / f"node{node}.log") for node in (0, 1))


@pytest.fixture(scope="module")
def torchrun_tp2(nodes, parallel_checkpoint, tmp_path_factory) -> TorchrunRun:
    folder = tmp_path_factory.mktemp("torchrun")
    procs = {}
    for node in (1, 0):
        argv = [
            sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
            "--node-rank", str(node), "--master-addr", nodes.addresses[0], "--master-port", "29500",
            "-m", "h3serve", "generate", PROMPT, "--model", str(parallel_checkpoint), "--steps", str(STEPS),
            "--seed", str(SEED), "--duration", str(DURATION_S), *NODE_FLAGS, "-tp", "2",
            "--save-raw", str(folder / f"node{node}.npz"), "-o", str(folder / f"node{node}.mp4"),
        ]
        procs[node] = nodes.start(node, argv, _node_env(), folder / f"node{node}.log")
    deadline = time.monotonic() + START_S
    codes = []
    for node in (0, 1):
        try:
            codes.append(procs[node].wait(timeout=max(1.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:  # a hang: the test reports it with both logs
            nodes.kill(procs[node])
            codes.append(None)
    return TorchrunRun(codes, folder)


def test_torchrun_tp2_across_two_nodes_matches_one_node(torchrun_tp2, tp2_one_node, one_rank):
    assert torchrun_tp2.codes == [0, 0], torchrun_tp2.logs()
    assert not (torchrun_tp2.folder / "node1.npz").exists()  # only the node with rank 0 writes the output
    video, audio, _, _ = read_raw(torchrun_tp2.folder / "node0.npz")
    np.testing.assert_array_equal(video, tp2_one_node.video)
    np.testing.assert_array_equal(audio, tp2_one_node.audio)
    assert np.abs(video - one_rank.video).max() <= TOLERANCE and np.abs(audio - one_rank.audio).max() <= TOLERANCE
    assert video.std() > 0.05  # a real picture, not a vacuous comparison


# The by-hand session's requests: U2 once; a long one during which rank 1 alone is killed (node 1 starts it again
# and both nodes rejoin); U2 again; a long one during which the whole of node 1 is killed.
REQUEST_STEPS = (STEPS, 30, STEPS, 30)
KILL_RANK, KILL_NODE = 1, 3  # the requests during which node 1's rank, then node 1, is killed


def rank_processes(node: subprocess.Popen) -> list[psutil.Process]:
    """The rank processes under a node's process: children of its fork server (H3SERVE_RANK_START=forkserver),
    or spawned."""
    ranks = []
    for child in psutil.Process(node.pid).children(recursive=True):
        parent = child.parent()
        if "spawn_main" in " ".join(child.cmdline()) or (parent and "forkserver" in " ".join(parent.cmdline())):
            ranks.append(child)
    return ranks


@dataclass
class EnvVarRun:
    messages: list[dict]  # what node 0 reported, in order
    failed_after_s: dict[int, float]  # request -> seconds from the kill to node 0's report of its failure
    leader_code: int | None
    folder: Path

    def logs(self) -> str:
        return f"node 0 said {self.messages}\n" + "\n".join(
            log_tail(self.folder / f"node{node}.log") for node in (0, 1)
        )

    def outcome(self, request: int) -> dict | None:
        """What request `request` ended with: {"output": file} or {"failed": message}."""
        return next((m for m in self.messages if m.get("request") == request and "step" not in m), None)


@pytest.fixture(scope="module")
def env_var_u2(nodes, parallel_checkpoint, tmp_path_factory) -> EnvVarRun:
    folder = tmp_path_factory.mktemp("env_vars")
    flags = [*NODE_FLAGS, "--usp", "2", "--collective-timeout", f"{COLLECTIVE_TIMEOUT_S:g}"]
    rendezvous = {"NNODES": "2", "MASTER_ADDR": nodes.addresses[0], "MASTER_PORT": "29600"}
    # --warmup off: the leader here is a script that runs no warm-up, and every rank must run the same requests
    follower = nodes.start(1, [sys.executable, "-m", "h3serve", "serve", str(parallel_checkpoint), *flags,
                               "--warmup", "off"],
                           _node_env(**rendezvous, NODE_RANK="1"), folder / "node1.log")
    steps = ",".join(str(n) for n in REQUEST_STEPS)
    leader = nodes.start(0, [sys.executable, str(LEADER), str(parallel_checkpoint), *flags, "--out", str(folder),
                             "--steps", steps], _node_env(**rendezvous, NODE_RANK="0"), folder / "node0.log", pipe=True)
    lines = JsonLines(leader.stdout)
    messages, killed, failed_after_s, code = [], {}, {}, None
    # Each wait may include a load (the start, a restart); after a kill the bound is the collective timeout.
    while (message := lines.next(START_S if len(killed) == len(failed_after_s) else COLLECTIVE_TIMEOUT_S + MARGIN_S)):
        messages.append(message)
        request = message.get("request")
        if "step" in message and request in (KILL_RANK, KILL_NODE) and request not in killed:
            for victim in rank_processes(follower) if request == KILL_RANK else []:
                victim.kill()
            if request == KILL_NODE:
                nodes.kill(follower)
            killed[request] = time.monotonic()
        elif "failed" in message and request in killed:
            failed_after_s[request] = time.monotonic() - killed[request]
    try:
        code = leader.wait(timeout=30)
    except subprocess.TimeoutExpired:  # it hangs in close; the test reports it
        nodes.kill(leader)
    return EnvVarRun(messages, failed_after_s, code, folder)


def test_env_var_u2_across_two_nodes_is_bit_identical_to_one_rank(env_var_u2, one_rank):
    for request in (0, KILL_RANK + 1):  # the first request, and the first after the nodes rejoined
        outcome = env_var_u2.outcome(request)
        assert outcome is not None and "output" in outcome, env_var_u2.logs()
        video, audio, _, _ = read_raw(Path(outcome["output"]))
        np.testing.assert_array_equal(video, one_rank.video)
        np.testing.assert_array_equal(audio, one_rank.audio)


def test_a_killed_rank_on_another_node_fails_the_request_and_the_nodes_rejoin(env_var_u2):
    """Node 1's rank is killed, node 1 stays: node 0 fails the request at once naming the rank, starts its own
    rank again behind the error, node 1 starts its rank again, and they meet for the next request."""
    failed = env_var_u2.outcome(KILL_RANK)
    assert failed is not None and "failed" in failed, env_var_u2.logs()
    assert failed["failed"].startswith("rank 0 lost its connection to rank 1 (node 1): "), failed
    assert env_var_u2.failed_after_s.get(KILL_RANK, float("inf")) <= COLLECTIVE_TIMEOUT_S + MARGIN_S
    assert "output" in (env_var_u2.outcome(KILL_RANK + 1) or {}), env_var_u2.logs()


def test_a_killed_node_fails_the_request_naming_it_within_the_collective_timeout(env_var_u2, capsys):
    run = env_var_u2
    failed = run.outcome(KILL_NODE)
    assert failed is not None, f"no answer within {COLLECTIVE_TIMEOUT_S + MARGIN_S:g} s of the kill\n{run.logs()}"
    assert "failed" in failed, f"the request ended before the kill\n{run.logs()}"
    assert run.failed_after_s.get(KILL_NODE, float("inf")) <= COLLECTIVE_TIMEOUT_S + MARGIN_S
    assert failed["failed"].startswith("rank 0 lost its connection to rank 1 (node 1): "), failed
    assert {"closed": True} in run.messages and run.leader_code == 0, run.logs()  # node 0 then shuts down cleanly
    with capsys.disabled():
        seconds = {request: round(s, 2) for request, s in run.failed_after_s.items()}
        print(f"\nfrom each kill (by request) to node 0's error: {seconds} s; last: {failed['failed']}")
