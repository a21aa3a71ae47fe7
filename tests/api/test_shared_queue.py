"""Two `h3serve serve` processes on one PostgreSQL job store (the tiny checkpoint), with one shared data dir or with
their outputs in one bucket and no shared disk: every job completes exactly once and is served by either server;
a server killed mid-job (or mid-upload) loses its lease and the other reruns the job."""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import psycopg
import pytest
from api_servers import start_live_server
from tcp_proxy import TcpProxy
from waiting import wait_until

pytestmark = pytest.mark.slow
LEASE_S = 3.0
JOB = {"prompt": "waves on a beach", "seconds": "4", "size": "128x64", "num_inference_steps": 1}
SLOW_UPLOAD_BYTES_S = 4000  # the tiny MP4 (tens of KB) takes seconds to go up: time to kill its server


def completions(url: str) -> dict[str, tuple[str, int, str | None]]:
    with psycopg.connect(url) as db:
        rows = db.execute("SELECT id, status, completions, owner FROM jobs").fetchall()
    return {job_id: (status, count, owner) for job_id, status, count, owner in rows}


def test_two_servers_share_one_queue_exactly_once_and_survive_a_kill(tiny_checkpoint, postgres_url, tmp_path):
    data_dir = tmp_path / "shared"
    flags = ("--job-store", postgres_url, "--job-lease", str(LEASE_S), "--threads", "1", "--max-queue", "32")
    with ThreadPoolExecutor(2) as pool:
        servers = list(pool.map(lambda _: start_live_server(tiny_checkpoint, data_dir, *flags), range(2)))
    try:
        clients = [httpx.Client(base_url=s.url, timeout=30) for s in servers]
        ids = []
        for i in range(12):  # alternately to both servers
            response = clients[i % 2].post("/v1/videos", json={**JOB, "seed": i})
            assert response.status_code == 200, response.text
            ids.append(response.json()["id"])
        wait_until(lambda: all(c[0] == "completed" for c in completions(postgres_url).values()), timeout_s=120,
                   interval_s=0.2, what="12 jobs completed")
        done = completions(postgres_url)
        assert sorted(done) == sorted(ids) and {count for _, count, _ in done.values()} == {1}
        assert len({owner for _, _, owner in done.values()}) == 2  # both servers ran jobs
        for job_id in ids:  # either server answers for every job, with the same bytes
            videos = [c.get(f"/v1/videos/{job_id}/content") for c in clients]
            assert [v.status_code for v in videos] == [200, 200] and videos[0].content == videos[1].content
            assert {c.get(f"/v1/videos/{job_id}").json()["status"] for c in clients} == {"completed"}

        long = clients[0].post("/v1/videos", json={**JOB, "num_inference_steps": 40, "seed": 99}).json()["id"]
        owner = wait_until(lambda: (c := completions(postgres_url)[long])[0] == "in_progress" and c[2],
                           interval_s=0.05, what="the long job claimed")
        pid = int(owner.split(":")[1])
        victim = next(s for s in servers if s.proc.pid == pid)
        survivor = next(s for s in servers if s is not victim)
        wait_until(lambda: clients[0].get(f"/v1/videos/{long}").json()["progress"] > 0, interval_s=0.05,
                   what="the long job denoising")
        os.killpg(victim.proc.pid, signal.SIGKILL)  # the server and its rank processes, mid-job
        victim.proc.wait(10)
        killed_at = time.monotonic()
        survivor_client = clients[servers.index(survivor)]
        job = wait_until(lambda: (j := survivor_client.get(f"/v1/videos/{long}").json())["status"] == "completed"
                         and j, timeout_s=LEASE_S + 60, interval_s=0.2, what="the rerun on the other server")
        rerun_s = time.monotonic() - killed_at
        status, count, new_owner = completions(postgres_url)[long]
        assert (status, count) == ("completed", 1) and new_owner != owner and job["progress"] == 100
        assert survivor_client.get(f"/v1/videos/{long}/content").status_code == 200
        assert len(completions(postgres_url)) == 13, "no job lost or duplicated"
        with psycopg.connect(postgres_url) as db:
            (job_s,) = db.execute("SELECT inference_time_s FROM jobs WHERE id = %s", (long,)).fetchone()
        # Within the lease plus one run of the job (and a few seconds of polling and clock granularity).
        assert rerun_s < LEASE_S + job_s + 5, (rerun_s, job_s)
    finally:
        for server in servers:
            server.stop()


def test_two_servers_one_bucket_no_shared_disk_and_a_kill_mid_upload(tiny_checkpoint, postgres_url, ceph_gateway,
                                                                    tmp_path):
    """Each server its own data dir; outputs in one bucket (each server reaches it through its own proxy). A job
    made on one is downloaded, listed and deleted from the other. The server uploading a job is killed (kill -9)
    while its MP4 goes up slowly: the MP4 is never in the bucket half written, and the other server reruns the job
    to the same bytes."""
    bucket = ceph_gateway.new_bucket()
    proxies = [TcpProxy(ceph_gateway.endpoint_url) for _ in range(2)]
    flags = ("--job-store", postgres_url, "--job-lease", str(LEASE_S), "--threads", "1",
             "--output-store", f"s3://{bucket}/h3", "--output-upload-attempts", "3")
    with ThreadPoolExecutor(2) as pool:
        servers = list(pool.map(
            lambda i: start_live_server(tiny_checkpoint, tmp_path / f"data{i}", *flags, "--s3-endpoint-url",
                                        proxies[i].url, env=ceph_gateway.credentials_env), range(2)))
    s3 = ceph_gateway.client()

    def stored(job_id: str, name: str = "video.mp4") -> bytes | None:
        try:
            return s3.get_object(Bucket=bucket, Key=f"h3/{job_id}/{name}")["Body"].read()
        except s3.exceptions.NoSuchKey:
            return None

    try:
        clients = [httpx.Client(base_url=s.url, timeout=30) for s in servers]
        made = clients[0].post("/v1/videos", json={**JOB, "seed": 3}).json()["id"]
        wait_until(lambda: completions(postgres_url)[made][0] == "completed", timeout_s=120, interval_s=0.1,
                   what="the job made on server 0")
        first = clients[1].get(f"/v1/videos/{made}/content")  # from the other server: no shared disk needed
        assert first.status_code == 200 and first.content == stored(made)
        assert [v["id"] for v in clients[1].get("/v1/videos").json()["data"]] == [made]
        assert clients[1].delete(f"/v1/videos/{made}").status_code == 200 and stored(made) is None
        assert clients[0].get(f"/v1/videos/{made}").status_code == 404

        again = clients[1].post("/v1/videos", json={**JOB, "seed": 3}).json()["id"]  # the same video again
        mp4_put = f"PUT /{bucket}/h3/{again}/video.mp4 "
        for proxy in proxies:
            proxy.slow(mp4_put, SLOW_UPLOAD_BYTES_S)
        wait_until(lambda: any(p.saw(mp4_put) for p in proxies), timeout_s=120, interval_s=0.02,
                   what="the MP4's upload under way")
        uploading = next(i for i, p in enumerate(proxies) if p.saw(mp4_put))
        os.killpg(servers[uploading].proc.pid, signal.SIGKILL)  # the server and its ranks, mid-upload
        servers[uploading].proc.wait(10)
        assert stored(again) is None  # the upload never completed: no object, not a half one
        proxies[1 - uploading].slow("", None)
        survivor_client = clients[1 - uploading]
        wait_until(lambda: survivor_client.get(f"/v1/videos/{again}").json()["status"] == "completed",
                   timeout_s=LEASE_S + 60, interval_s=0.2, what="the rerun on the other server")
        assert completions(postgres_url)[again][:2] == ("completed", 1)
        assert survivor_client.get(f"/v1/videos/{again}/content").content == stored(again) == first.content
    finally:
        for server in servers:
            server.stop()
        for proxy in proxies:
            proxy.close()
