"""Where each rank runs, so that a rank which loses a peer in a collective can say which rank and node it lost.

Every rank sends, once at start-up, the address its collectives leave from (the local end of the route to the
rendezvous host, see h3serve.parallel.rendezvous). A transport error names the peer's address (gloo: "Read error
[10.0.0.2]:28388: Connection reset by peer"); the ranks behind it are the lost ones. A timeout names nobody: then
every rank on another node is a suspect (on two nodes: exactly the other one). Node k is the k-th distinct
address in rank order: each node's executor starts one contiguous block of the ranks.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch.distributed as dist

from h3serve.parallel.rendezvous import rendezvous_host, route_address

_ADDRESS = re.compile(r"\[([0-9A-Fa-f.:]+)\]")
_TIMEOUT = re.compile(r"timed out|timeout", re.IGNORECASE)


def is_lost_connection(error: BaseException) -> bool:
    """Whether `error` is a collective that lost a peer (torch's distributed errors; gloo's transport errors)."""
    return isinstance(error, dist.DistError) or "gloo/transport" in str(error)


def _spans(ranks: list[int]) -> str:
    """[1, 2, 3, 5] -> "1-3, 5"."""
    spans: list[list[int]] = []
    for rank in ranks:
        if spans and rank == spans[-1][-1] + 1:
            spans[-1].append(rank)
        else:
            spans.append([rank])
    return ", ".join(str(s[0]) if len(s) == 1 else f"{s[0]}-{s[-1]}" for s in spans)


@dataclass(frozen=True)
class Peers:
    addresses: tuple[str, ...]  # by global rank

    @classmethod
    def gather(cls, init_method: str, world: int) -> Peers:
        """Collective over the whole world: every rank's address, in rank order."""
        mine = route_address(rendezvous_host(init_method)) or "?"
        everyone: list[str | None] = [None] * world
        dist.all_gather_object(everyone, mine)
        return cls(tuple(str(a) for a in everyone))

    def node_of(self, rank: int) -> int:
        return list(dict.fromkeys(self.addresses)).index(self.addresses[rank])

    def suspects(self, error: BaseException, rank: int) -> list[int]:
        """The ranks `error` (raised on `rank`) lost: those at the addresses it names, else every rank on
        another node, else every other rank."""
        named = set(_ADDRESS.findall(str(error)))
        others = [r for r in range(len(self.addresses)) if r != rank]
        found = [r for r in others if self.addresses[r] in named]
        remote = [r for r in others if self.addresses[r] != self.addresses[rank]]
        return found or remote or others

    def describe_loss(self, error: BaseException, rank: int) -> str:
        """One sentence, for the job's error: which ranks and nodes this rank lost, and how."""
        lost = self.suspects(error, rank)
        nodes = sorted({self.node_of(r) for r in lost})
        who = (f"rank{'s' if len(lost) > 1 else ''} {_spans(lost)} "
               f"(node{'s' if len(nodes) > 1 else ''} {_spans(nodes)})")
        if _TIMEOUT.search(str(error)):
            return (f"rank {rank} waited longer than the collective timeout for {who}: a rank or its node stopped "
                    "answering, or the network between them failed")
        return f"rank {rank} lost its connection to {who}: its process or node died, or the network failed"
