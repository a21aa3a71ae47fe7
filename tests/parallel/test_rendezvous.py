"""Where ranks meet: the single-node default and the multi-node environment torchrun (or a user) sets."""

from __future__ import annotations

import pytest

from h3serve.parallel.rendezvous import Rendezvous, nodes_from_env

LOCAL = "tcp://127.0.0.1:29500"


def test_rendezvous_from_torchrun_environment():
    env = {
        "MASTER_ADDR": "10.0.0.1",
        "MASTER_PORT": "29500",
        "WORLD_SIZE": "2",
        "RANK": "1",
        "GROUP_RANK": "1",
        "LOCAL_WORLD_SIZE": "1",
        "TORCHELASTIC_USE_AGENT_STORE": "True",
    }
    r = Rendezvous.from_env(env)
    assert (r.init_method, r.node_rank, r.nnodes, r.is_leader) == ("tcp://10.0.0.1:29501", 1, 2, False)
    assert list(r.local_ranks(8)) == [4, 5, 6, 7]
    manual = Rendezvous.from_env({"MASTER_ADDR": "h", "MASTER_PORT": "7000", "NNODES": "4", "NODE_RANK": "0"})
    assert (manual.init_method, manual.is_leader, list(manual.local_ranks(4))) == ("tcp://h:7000", True, [0])
    assert Rendezvous.from_env({}).nnodes == nodes_from_env({}) == 1
    with pytest.raises(ValueError, match="multiple of the 4 nodes"):
        manual.local_ranks(6)


@pytest.mark.parametrize(
    "env, message",
    [
        ({"NNODES": "abc"}, "NNODES='abc' must be an integer"),
        ({"NNODES": "0"}, "NNODES=0 must be >= 1"),
        ({"NNODES": "2", "MASTER_ADDR": "h", "MASTER_PORT": "x"}, "MASTER_PORT='x' must be an integer"),
        ({"NNODES": "2", "MASTER_ADDR": "h", "MASTER_PORT": "29500", "NODE_RANK": "2"}, "NODE_RANK=2 must be below"),
    ],
)
def test_bad_launcher_environment_is_a_config_error(env, message):
    from h3serve.errors import ConfigError
    from h3serve.parallel.rendezvous import Rendezvous

    with pytest.raises(ConfigError, match=message):
        Rendezvous.from_env(env)


_RANK_ZERO = """
import os, sys
from datetime import timedelta
import torch.distributed as dist
from h3serve.parallel.rendezvous import rank_environment
from h3serve.parallel.launch import process_group_options
rank_environment(os.environ, sys.argv[1])
dist.init_process_group(init_method=sys.argv[1], rank=0, world_size=1, timeout=timedelta(seconds=20),
                        **process_group_options(cuda=False))
dist.barrier()
dist.destroy_process_group()
print("MET")
"""


def test_a_rank_started_under_torchrun_hosts_its_own_store(monkeypatch):
    """torchrun's TORCHELASTIC_USE_AGENT_STORE would make global rank 0 a client of a store nobody serves on
    h3serve's port (MASTER_PORT + 1): the rank environment drops it, and rank 0 meets its group there."""
    import os

    from torch.distributed.rendezvous import _torchelastic_use_agent_store

    from h3serve.parallel.rendezvous import rank_environment

    env = {"TORCHELASTIC_USE_AGENT_STORE": "True", "PATH": "/bin"}
    rank_environment(env, LOCAL)
    assert env == {"PATH": "/bin"}
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    assert _torchelastic_use_agent_store()  # what torch.distributed reads: every rank would be a store client
    rank_environment(os.environ, LOCAL)
    assert not _torchelastic_use_agent_store()


def test_ranks_on_several_nodes_use_the_interface_that_routes_to_the_rendezvous(monkeypatch):
    """gloo would announce the address the host name resolves to (often loopback); across nodes the ranks use
    the interface the route to MASTER_ADDR leaves from, unless GLOO_SOCKET_IFNAME names one. (The two-namespace
    test, tests/parallel/test_two_namespaces.py, runs this on real interfaces.)"""
    from types import SimpleNamespace

    from h3serve.parallel import rendezvous
    from h3serve.parallel.rendezvous import interface_with, rank_environment, route_address

    assert interface_with(route_address("127.0.0.1")) == "lo"  # the kernel's own answer, on any Linux host
    assert route_address("no-such-host.invalid") is None
    one_machine = {}
    rank_environment(one_machine, LOCAL)
    assert one_machine == {}  # a loopback rendezvous: gloo's default serves

    monkeypatch.setattr(rendezvous, "route_address", lambda host: {"10.9.0.1": "10.9.0.2"}[host])
    interfaces = {"lo": ["127.0.0.1"], "eth0": ["192.0.2.5"], "ens5": ["fe80::1%ens5", "10.9.0.2"]}
    table = {name: [SimpleNamespace(address=a) for a in found] for name, found in interfaces.items()}
    monkeypatch.setattr(rendezvous.psutil, "net_if_addrs", lambda: table)
    other_node = {}
    rank_environment(other_node, "tcp://10.9.0.1:29501")
    assert other_node == {"GLOO_SOCKET_IFNAME": "ens5"}
    chosen = {"GLOO_SOCKET_IFNAME": "eth0"}
    rank_environment(chosen, "tcp://10.9.0.1:29501")
    assert chosen == {"GLOO_SOCKET_IFNAME": "eth0"}


@pytest.mark.slow
def test_rank_zero_meets_its_group_on_its_own_port_under_torchrun():
    import os
    import subprocess
    import sys

    from h3serve.parallel.rendezvous import free_port

    child = {**os.environ, "TORCHELASTIC_USE_AGENT_STORE": "True", "PYTHONPATH": os.getcwd()}
    done = subprocess.run([sys.executable, "-c", _RANK_ZERO, f"tcp://127.0.0.1:{free_port()}"], env=child,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "MET" in done.stdout, done.stderr[-2000:]
