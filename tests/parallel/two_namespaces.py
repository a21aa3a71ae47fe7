"""Two network namespaces joined by a veth pair: two "nodes" on one machine, each with its own network stack
(its own loopback, its own interface), reaching the other only at the pair's addresses.

Used by tests/parallel/test_two_namespaces.py. Making them needs CAP_NET_ADMIN (root) and `ip` (iproute2);
`TwoNodes.create` raises `NamespacesUnavailable` with the reason where the first namespace cannot be made.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

ADDRESSES = ("10.213.0.1", "10.213.0.2")  # private to the two namespaces: no clash with any other run's


class NamespacesUnavailable(Exception):
    """Network namespaces cannot be made here; the message says why."""


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")


@dataclass
class TwoNodes:
    names: tuple[str, str]  # the namespaces: node 0, node 1
    interfaces: tuple[str, str]  # each one's end of the veth pair
    addresses: tuple[str, str] = ADDRESSES
    started: list[subprocess.Popen] = field(default_factory=list)

    @classmethod
    def create(cls, tag: str) -> TwoNodes:
        """Node 0 at 10.213.0.1, node 1 at 10.213.0.2 (a /24 on the veth pair), loopback up in each; `tag` makes
        the names unique on this machine (interface names have at most 15 characters)."""
        nodes = cls(names=(f"h3n{tag}a", f"h3n{tag}b"), interfaces=(f"h3v{tag}a", f"h3v{tag}b"))
        try:
            _ip("netns", "add", nodes.names[0])
        except (OSError, RuntimeError) as e:
            raise NamespacesUnavailable(f"cannot create a network namespace ({e})") from None
        try:
            _ip("netns", "add", nodes.names[1])
            _ip("link", "add", nodes.interfaces[0], "netns", nodes.names[0], "type", "veth",
                "peer", "name", nodes.interfaces[1], "netns", nodes.names[1])
            for name, interface, address in zip(nodes.names, nodes.interfaces, nodes.addresses, strict=True):
                _ip("-n", name, "addr", "add", f"{address}/24", "dev", interface)
                _ip("-n", name, "link", "set", "lo", "up")
                _ip("-n", name, "link", "set", interface, "up")
        except BaseException:
            nodes.remove()
            raise
        return nodes

    def start(self, node: int, argv: list[str], env: dict[str, str], log: Path, pipe: bool = False) -> subprocess.Popen:
        """`argv` inside node `node`'s namespace, as the leader of a new process group (its ranks join the group,
        so one signal reaches the whole node); stderr (and stdout unless `pipe`) go to `log`."""
        with open(log, "w") as sink:
            proc = subprocess.Popen(
                ["ip", "netns", "exec", self.names[node], *argv], env=env, start_new_session=True,
                stdout=subprocess.PIPE if pipe else sink, stderr=sink, text=True,
            )
        self.started.append(proc)
        return proc

    @staticmethod
    def kill(proc: subprocess.Popen) -> None:
        """SIGKILL to the node: the process started there and every process it started."""
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def remove(self) -> None:
        """End what runs in the namespaces (all started here) and delete them, which deletes the veth pair."""
        for proc in self.started:
            self.kill(proc)
            proc.wait(timeout=30)
        for name in self.names:
            pids = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass
            subprocess.run(["ip", "netns", "del", name], capture_output=True)


class JsonLines:
    """The JSON lines a process writes on stdout, read by a thread so that each wait has a deadline."""

    def __init__(self, stream: IO[str]):
        self._lines: queue.Queue[dict | None] = queue.Queue()
        threading.Thread(target=self._read, args=(stream,), daemon=True).start()

    def _read(self, stream: IO[str]) -> None:
        for line in stream:
            if line.startswith("{"):
                self._lines.put(json.loads(line))
        self._lines.put(None)  # end of output

    def next(self, timeout_s: float) -> dict | None:
        """The next message; None at the end of the output or after `timeout_s`."""
        try:
            return self._lines.get(timeout=timeout_s)
        except queue.Empty:
            return None


def log_tail(path: Path, chars: int = 3000) -> str:
    return f"--- {path.name} ---\n" + path.read_text(errors="replace")[-chars:]
