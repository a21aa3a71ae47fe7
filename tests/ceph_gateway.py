"""A throwaway single-node Ceph cluster with an S3 gateway for the output-store tests: one monitor, one memstore OSD
and one RADOS gateway (Debian's `ceph-mon`, `ceph-osd`, `radosgw`: `make ceph`) on free loopback ports, every file
under one temp dir (see /work/shared/reference/ceph_single_node.md).

The daemons run as root (`--setuser root`): where the suite is not root, or the packages are missing, the start
raises `GatewayUnavailable` with the reason, and the fixture skips the tests that need it with that reason.

`shared_gateway` gives every pytest-xdist worker of one run the same gateway: the first to ask starts it and
records it in a state file beside the workers' temp dirs (under a file lock); the last to let go stops it.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import boto3
from botocore.config import Config

ACCESS_KEY = "H3SERVETESTACCESSKEY"
SECRET_KEY = "h3serve-test-secret-key-never-logged-0000"
USER_ID = "h3serve-tests"
START_TIMEOUT_S = 90.0
OSD_START_TRIES = 4
OSD_SETTLE_S = 2.0  # an OSD that lives this long got past its first requests to the monitor
BINARIES = ("monmaptool", "ceph-mon", "ceph-osd", "radosgw", "radosgw-admin", "ceph")


class GatewayUnavailable(RuntimeError):
    """The gateway cannot start here (not root, packages missing, a daemon failed): the reason."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


CONF = """\
[global]
fsid = {fsid}
mon host = v1:127.0.0.1:{mon_port}
mon initial members = a
auth cluster required = none
auth service required = none
auth client required = none
osd pool default size = 1
osd pool default min size = 1
osd pool default pg num = 8
osd pool default pgp num = 8
mon allow pool size one = true
osd crush chooseleaf type = 0
osd objectstore = memstore
memstore device bytes = 2147483648
mon data = {root}/mon/$cluster-$id
osd data = {root}/osd/$cluster-$id
run dir = {root}/run
admin socket = {root}/run/$name.asok
pid file = {root}/run/$name.pid
log file = {root}/log/$name.log
ms bind ipv6 = false
mon warn on pool no redundancy = false

[client.rgw.a]
rgw frontends = beast endpoint=127.0.0.1:{rgw_port}
rgw data = {root}/rgw
rgw enable usage log = false
"""


@dataclass
class CephGateway:
    root: Path
    endpoint_url: str
    conf: Path
    pids: list[int] = field(default_factory=list)  # monitor, OSD, gateway (processes of their own sessions)

    @property
    def credentials_env(self) -> dict[str, str]:
        """The standard AWS chain's environment variables for the gateway's test user."""
        return {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY, "AWS_DEFAULT_REGION": "us-east-1"}

    def client(self):  # noqa: ANN201 (a boto3 S3 client)
        return boto3.client("s3", endpoint_url=self.endpoint_url, aws_access_key_id=ACCESS_KEY,
                            aws_secret_access_key=SECRET_KEY, region_name="us-east-1",
                            config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 2}))

    def new_bucket(self) -> str:
        name = f"h3serve-{uuid.uuid4().hex[:12]}"
        self.client().create_bucket(Bucket=name)
        return name

    def alive(self) -> bool:
        return bool(self.pids) and all(_running(pid) for pid in self.pids)

    def stop(self) -> None:
        """SIGKILL to each daemon: memstore keeps nothing, and an OSD whose monitor is gone ignores SIGTERM."""
        for pid in self.pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for pid in self.pids:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)  # reaps our own children; another worker's are reaped by init
        shutil.rmtree(self.root, ignore_errors=True)

    def state(self) -> dict:
        return {"root": str(self.root), "endpoint_url": self.endpoint_url, "conf": str(self.conf), "pids": self.pids}

    @classmethod
    def from_state(cls, state: dict) -> CephGateway:
        return cls(Path(state["root"]), state["endpoint_url"], Path(state["conf"]), list(state["pids"]))


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped) is not running
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[-1][0] != "Z"
    except OSError:
        return True


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@contextlib.contextmanager
def shared_gateway(folder: Path) -> Iterator[CephGateway]:
    """The gateway every user of `folder` shares: started by the first, stopped by the last. A start that failed
    is recorded, so the other users skip with its reason at once instead of trying again."""
    lock, state_file = folder / "ceph-gateway.lock", folder / "ceph-gateway.json"
    with _locked(lock):
        state = json.loads(state_file.read_text()) if state_file.exists() else {}
        if "error" in state:
            raise GatewayUnavailable(state["error"])
        if not state or not CephGateway.from_state(state["gateway"]).alive():
            try:
                state = {"gateway": start_gateway().state(), "users": 0}
            except GatewayUnavailable as e:
                state_file.write_text(json.dumps({"error": str(e)}))
                raise
        state["users"] += 1
        state_file.write_text(json.dumps(state))
    try:
        yield CephGateway.from_state(state["gateway"])
    finally:
        with _locked(lock):
            state = json.loads(state_file.read_text())
            state["users"] -= 1
            if state["users"] <= 0:
                CephGateway.from_state(state["gateway"]).stop()
                state_file.unlink()
            else:
                state_file.write_text(json.dumps(state))


def start_gateway() -> CephGateway:
    """Start the cluster and its gateway, create the test user; `GatewayUnavailable` with the reason if it cannot."""
    if os.getuid() != 0:
        raise GatewayUnavailable("the single-node Ceph gateway runs its daemons as root; the suite is not root")
    missing = [b for b in BINARIES if shutil.which(b) is None]
    if missing:
        raise GatewayUnavailable(f"Ceph is not installed (missing {', '.join(missing)}): run `make ceph` "
                                 "(apt-get install ceph-mon ceph-osd radosgw)")
    root = Path(tempfile.mkdtemp(prefix="h3serve-ceph-"))
    for sub in ("mon", "osd", "run", "log", "rgw"):
        (root / sub).mkdir()
    mon_port, rgw_port = free_port(), free_port()
    conf = root / "ceph.conf"
    conf.write_text(CONF.format(fsid=uuid.uuid4(), mon_port=mon_port, rgw_port=rgw_port, root=root))
    gateway = CephGateway(root, f"http://127.0.0.1:{rgw_port}", conf)
    as_root = ("--setuser", "root", "--setgroup", "root")

    def run(*cmd: str) -> str:
        done = subprocess.run([cmd[0], "-c", str(conf), *cmd[1:]], capture_output=True, text=True, timeout=60)
        if done.returncode:
            raise GatewayUnavailable(f"{' '.join(cmd[:3])} failed ({done.returncode}): "
                                     f"{(done.stderr or done.stdout).strip()[-1500:]}")
        return done.stdout

    def daemon(*cmd: str) -> subprocess.Popen:
        with open(root / "log" / f"{cmd[0]}.out", "ab") as log:
            proc = subprocess.Popen([cmd[0], "-c", str(conf), "-f", *cmd[1:], *as_root], stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        gateway.pids.append(proc.pid)
        return proc

    try:
        subprocess.run(["monmaptool", "--create", "--fsid", conf.read_text().split("fsid = ")[1].split()[0],
                        "--addv", "a", f"[v1:127.0.0.1:{mon_port}]", str(root / "monmap")],
                       capture_output=True, check=True, timeout=30)
        run("ceph-mon", "--mkfs", "-i", "a", "--monmap", str(root / "monmap"), *as_root)
        daemon("ceph-mon", "-i", "a")
        osd_uuid = str(uuid.uuid4())  # the OSD's identity, given to the monitor and the OSD alike
        osd_id = run("ceph", "--connect-timeout", "30", "osd", "create", osd_uuid).strip()
        (root / "osd" / f"ceph-{osd_id}").mkdir()  # memstore keeps only its fsid and keyring files there
        run("ceph-osd", "-i", osd_id, "--mkfs", "--osd-uuid", osd_uuid, *as_root)
        for _ in range(OSD_START_TRIES):
            osd = daemon("ceph-osd", "-i", osd_id)
            try:  # a just-started OSD may ask the monitor before it knows the cluster's fsid, and exit ("wrong fsid")
                osd.wait(OSD_SETTLE_S)
            except subprocess.TimeoutExpired:
                break
            gateway.pids.remove(osd.pid)
        else:
            raise GatewayUnavailable(f"the OSD exited right after its start, {OSD_START_TRIES} times")
        daemon("radosgw", "-n", "client.rgw.a")
        _wait_for_s3(gateway)
        run("radosgw-admin", "user", "create", "--uid", USER_ID, "--display-name", USER_ID, "--access-key",
            ACCESS_KEY, "--secret", SECRET_KEY)
        _wait_for_user(gateway)
    except (GatewayUnavailable, subprocess.SubprocessError, OSError) as e:
        logs = "".join(p.read_text(errors="replace")[-800:] for p in sorted((root / "log").glob("*")))
        gateway.stop()
        raise GatewayUnavailable(f"the Ceph gateway did not start: {e}\n{logs}") from None
    return gateway


def _wait_for_s3(gateway: CephGateway) -> None:
    """Until the gateway answers HTTP (any status: the user does not exist yet)."""
    deadline = time.monotonic() + START_TIMEOUT_S
    host, port = gateway.endpoint_url.removeprefix("http://").split(":")
    while time.monotonic() < deadline:
        if not gateway.alive():
            raise GatewayUnavailable("a Ceph daemon exited during start-up")
        try:
            with socket.create_connection((host, int(port)), timeout=1):
                return
        except OSError:
            time.sleep(0.2)
    raise GatewayUnavailable(f"the gateway did not answer within {START_TIMEOUT_S:g} s")


def _wait_for_user(gateway: CephGateway) -> None:
    """Until the test user can list its buckets (the gateway's pools are created on its first requests)."""
    deadline = time.monotonic() + START_TIMEOUT_S
    error: Exception | None = None
    while time.monotonic() < deadline:
        try:
            gateway.client().list_buckets()
            return
        except Exception as e:  # noqa: BLE001 (retried until the deadline, then reported)
            error = e
            time.sleep(0.3)
    raise GatewayUnavailable(f"the gateway refused the test user: {error}")
