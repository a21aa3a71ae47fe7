"""Where the rank processes meet: one machine (a free local port) or several nodes (torchrun / env variables).

Multi-node: start one `h3serve` process per node, e.g.
    torchrun --nnodes 2 --nproc-per-node 1 --node-rank K --master-addr HOST --master-port 29500 \\
        -m h3serve serve MODEL --num-gpus 16 ...
or set MASTER_ADDR, MASTER_PORT, NNODES and NODE_RANK by hand. Each node's executor spawns its share of
the ranks (`world / nnodes`, global ranks `node · local .. node · local + local - 1`); node 0 holds global
rank 0, which takes the requests; the other nodes only keep their ranks alive. Under torchrun the agent
already listens on MASTER_PORT, so the ranks meet on MASTER_PORT + 1 (H3SERVE_DIST_PORT overrides), where global
rank 0 hosts the store: the ranks must not inherit torchrun's TORCHELASTIC_USE_AGENT_STORE (see `rank_environment`).
The ranks' gloo connections use the network interface that routes to MASTER_ADDR (GLOO_SOCKET_IFNAME overrides):
gloo's own default, the address the host name resolves to, is a loopback address on many hosts. docs/scaling.md
has the recipe.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from urllib.parse import urlsplit

import psutil

from h3serve.errors import ConfigError


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env_int(env: Mapping[str, str], name: str, default: str | None = None, minimum: int = 0) -> int:
    """An integer launcher variable; a malformed one is a ConfigError naming it (never a traceback)."""
    text = env.get(name, default)
    try:
        value = int(text)
    except (TypeError, ValueError):
        raise ConfigError(f"environment variable {name}={text!r} must be an integer") from None
    if value < minimum:
        raise ConfigError(f"environment variable {name}={value} must be >= {minimum}")
    return value


def nodes_from_env(env: Mapping[str, str] | None = None) -> int:
    """How many nodes the environment describes (1 without a multi-node launcher)."""
    env = os.environ if env is None else env
    if "NNODES" in env:
        return _env_int(env, "NNODES", minimum=1)
    if "WORLD_SIZE" in env and "MASTER_ADDR" in env:  # torchrun: one launcher process per node
        return max(1, _env_int(env, "WORLD_SIZE", minimum=1) // _env_int(env, "LOCAL_WORLD_SIZE", "1", minimum=1))
    return 1


AGENT_STORE_VARIABLE = "TORCHELASTIC_USE_AGENT_STORE"
GLOO_INTERFACE_VARIABLE = "GLOO_SOCKET_IFNAME"


def route_address(host: str) -> str | None:
    """The local address this machine's packets to `host` leave from (None if `host` does not resolve).

    A UDP socket's `connect` only asks the kernel for the route: nothing is sent."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, kind, proto) as s:
            s.connect(address)
            return s.getsockname()[0].split("%")[0]  # an IPv6 link-local address carries its %scope
    except OSError:
        return None


def interface_with(address: str) -> str | None:
    """The name of the network interface that holds `address` (None if none does)."""
    for name, addresses in psutil.net_if_addrs().items():
        if any(a.address.split("%")[0] == address for a in addresses):
            return name
    return None


def rendezvous_host(init_method: str) -> str:
    """HOST of a tcp://HOST:PORT init method."""
    return urlsplit(init_method).hostname or ""


def rank_environment(env: MutableMapping[str, str], init_method: str) -> None:
    """Prepare a rank process' environment (in place) for `init_process_group` on h3serve's own rendezvous.

    torchrun sets TORCHELASTIC_USE_AGENT_STORE=True for the processes it starts: torch.distributed then makes
    every rank, rank 0 included, a client of the agent's store at the init address. h3serve's ranks meet on their
    own port (MASTER_PORT + 1, or a free local one), where nobody would serve that store, and the start hangs;
    without the variable global rank 0 hosts the store there, as planned.

    Across nodes, gloo announces to its peers the address the host name resolves to: on many hosts (/etc/hosts
    naming the host 127.0.1.1 or 127.0.0.1) a loopback address, which the other nodes cannot reach, and the start
    fails. Unless GLOO_SOCKET_IFNAME names one already, the interface that routes to the rendezvous host is used.
    """
    env.pop(AGENT_STORE_VARIABLE, None)
    if GLOO_INTERFACE_VARIABLE in env:
        return
    local = route_address(rendezvous_host(init_method))
    if local is None or ipaddress.ip_address(local).is_loopback:  # one machine (or an unknown host): gloo's default
        return
    interface = interface_with(local)
    if interface is not None:
        env[GLOO_INTERFACE_VARIABLE] = interface


@dataclass(frozen=True)
class Rendezvous:
    init_method: str  # tcp://HOST:PORT where global rank 0 hosts the store
    node_rank: int = 0
    nnodes: int = 1

    @property
    def is_leader(self) -> bool:
        """The node with global rank 0: the only one that takes requests."""
        return self.node_rank == 0

    def local_ranks(self, world_size: int) -> range:
        if world_size % self.nnodes:
            raise ConfigError(f"--num-gpus {world_size} is not a multiple of the {self.nnodes} nodes")
        local = world_size // self.nnodes
        return range(self.node_rank * local, (self.node_rank + 1) * local)

    @classmethod
    def local(cls) -> Rendezvous:
        return cls(init_method=f"tcp://127.0.0.1:{free_port()}")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Rendezvous:
        """Multi-node when the environment names several nodes; otherwise a fresh local port."""
        env = os.environ if env is None else env
        nnodes = nodes_from_env(env)
        if nnodes <= 1:
            return cls.local()
        if "MASTER_ADDR" not in env or "MASTER_PORT" not in env:
            raise ConfigError("multi-node runs need MASTER_ADDR and MASTER_PORT (set by torchrun, or by hand)")
        rank_var = next((v for v in ("NODE_RANK", "GROUP_RANK", "RANK") if v in env), "NODE_RANK")
        node_rank = _env_int(env, rank_var, "0")
        if node_rank >= nnodes:
            raise ConfigError(f"environment variable {rank_var}={node_rank} must be below the {nnodes} nodes")
        port = _env_int(env, "MASTER_PORT", minimum=1)
        if "H3SERVE_DIST_PORT" in env:
            port = _env_int(env, "H3SERVE_DIST_PORT", minimum=1)
        elif env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true":
            port += 1  # the torchrun agent's own store holds MASTER_PORT
        return cls(init_method=f"tcp://{env['MASTER_ADDR']}:{port}", node_rank=node_rank, nnodes=nnodes)

    def fresh(self) -> Rendezvous:
        """The rendezvous for a restart: single-node picks a new port (the old one may linger in TIME_WAIT)."""
        return Rendezvous.local() if self.nnodes == 1 else self
