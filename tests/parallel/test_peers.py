"""A rank that loses a peer in a collective names the rank and node it lost (tests/parallel/test_two_namespaces.py
shows it across real sockets)."""

from __future__ import annotations

import torch.distributed as dist

from h3serve.parallel.peers import Peers, is_lost_connection

RESET = RuntimeError("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
                     "[10.0.0.{}]:28388: Connection reset by peer. This is typically caused by a remote worker hanging")
TIMEOUT = RuntimeError("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:129] Timed out "
                       "waiting 15000ms for send operation to complete")


def _reset(host: int) -> RuntimeError:
    return RuntimeError(str(RESET).format(host))


def test_the_lost_peer_is_the_rank_behind_the_address_the_error_names():
    two_nodes = Peers(("10.0.0.1", "10.0.0.2"))
    assert two_nodes.describe_loss(_reset(2), rank=0) == (
        "rank 0 lost its connection to rank 1 (node 1): its process or node died, or the network failed")
    # Two ranks a node: the address tells the node, not which of its ranks.
    four_ranks = Peers(("10.0.0.1", "10.0.0.1", "10.0.0.2", "10.0.0.2"))
    assert four_ranks.suspects(_reset(2), rank=1) == [2, 3]
    assert "lost its connection to ranks 2-3 (node 1)" in four_ranks.describe_loss(_reset(2), rank=1)


def test_a_timeout_names_no_address_so_every_rank_on_another_node_is_a_suspect():
    three_nodes = Peers(("10.0.0.1", "10.0.0.1", "10.0.0.2", "10.0.0.2", "10.0.0.3", "10.0.0.3"))
    assert three_nodes.describe_loss(TIMEOUT, rank=0) == (
        "rank 0 waited longer than the collective timeout for ranks 2-5 (nodes 1-2): a rank or its node stopped "
        "answering, or the network between them failed")
    assert Peers(("10.0.0.1", "10.0.0.2")).suspects(TIMEOUT, rank=1) == [0]
    one_node = Peers(("127.0.0.1",) * 3)  # one machine: every other rank (the parent names the one that died)
    assert one_node.suspects(TIMEOUT, rank=0) == [1, 2]


def test_only_collective_failures_count_as_a_lost_peer():
    assert is_lost_connection(_reset(2)) and is_lost_connection(TIMEOUT)
    assert is_lost_connection(dist.DistBackendError("NCCL error: remote process exited or there was a network error"))
    assert not is_lost_connection(RuntimeError("shape mismatch")) and not is_lost_connection(ValueError("x"))
