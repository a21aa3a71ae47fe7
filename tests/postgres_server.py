"""A throwaway PostgreSQL server for the tests: Debian's `initdb` + `pg_ctl` in a temp dir, on a free port.

`initdb` and `postgres` refuse to run as root; when the suite runs as root (CI), they run as the `postgres`
system user (`runuser`), on a folder it owns. Never skipped: a missing server is an error (`make postgresql`).
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path

import psycopg

USER = "h3serve"


def _bindir() -> Path:
    found = shutil.which("initdb")
    if found:
        return Path(found).parent
    versions = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(Path(p).parts[-3]))
    if not versions:
        raise RuntimeError("PostgreSQL's initdb was not found: run `make postgresql` (apt-get install postgresql)")
    return Path(versions[-1]).parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class PostgresServer:
    root: Path
    port: int
    prefix: list[str]  # runs a command as the server's user
    bindir: Path

    @property
    def admin_url(self) -> str:
        return f"postgresql://{USER}@127.0.0.1:{self.port}/postgres"

    def new_database(self) -> str:
        """The URL of a fresh, empty database."""
        name = f"t_{uuid.uuid4().hex[:12]}"
        with psycopg.connect(self.admin_url, autocommit=True) as db:
            db.execute(f"CREATE DATABASE {name}")
        return f"postgresql://{USER}@127.0.0.1:{self.port}/{name}"

    def stop(self) -> None:
        subprocess.run([*self.prefix, str(self.bindir / "pg_ctl"), "-D", str(self.root / "data"), "-m", "immediate",
                        "-w", "stop"], capture_output=True, timeout=60)
        shutil.rmtree(self.root, ignore_errors=True)


def start_postgres() -> PostgresServer:
    bindir = _bindir()
    root = Path(tempfile.mkdtemp(prefix="h3serve-pg-"))
    prefix: list[str] = []
    if os.getuid() == 0:
        user = pwd.getpwnam("postgres")
        os.chown(root, user.pw_uid, user.pw_gid)
        prefix = ["runuser", "-u", "postgres", "--"]
    data, port = root / "data", _free_port()

    def run(*cmd: str) -> None:
        done = subprocess.run([*prefix, *cmd], capture_output=True, text=True, timeout=120)
        if done.returncode:
            log = (root / "log").read_text() if (root / "log").exists() else ""
            raise RuntimeError(f"{cmd[0]} failed ({done.returncode}): {done.stderr.strip()} {log[-2000:]}")

    run(str(bindir / "initdb"), "-D", str(data), "-U", USER, "--auth=trust", "-E", "UTF8", "--no-sync")
    options = f"-p {port} -k {root} -c listen_addresses=127.0.0.1 -c fsync=off -c synchronous_commit=off"
    run(str(bindir / "pg_ctl"), "-D", str(data), "-o", options, "-l", str(root / "log"), "-w", "-t", "60", "start")
    return PostgresServer(root, port, prefix, bindir)
