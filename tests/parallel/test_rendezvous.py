"""Where ranks meet: the single-node default and the multi-node environment torchrun (or a user) sets."""

from __future__ import annotations

import pytest

from h3serve.parallel.rendezvous import Rendezvous, nodes_from_env


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
    from h3serve.config import ConfigError
    from h3serve.parallel.rendezvous import Rendezvous

    with pytest.raises(ConfigError, match=message):
        Rendezvous.from_env(env)
