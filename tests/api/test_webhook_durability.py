"""The outbox survives a `kill -9`: a server killed while its delivery attempt hangs leaves the event in the store,
and the restarted server (SQLite) or the other server on the same PostgreSQL (once the dead one's lease runs out)
delivers it, under the same webhook-id. Servers are the real app on a fake engine, each a process of its own."""

from __future__ import annotations

import time

import httpx
import psycopg
from openai import OpenAI
from waiting import wait_until
from webhook_receiver import HANG, Receiver, receiver
from webhook_servers import ServerProcess, serve_webhooks, start_process

SDK = OpenAI(api_key="unused", base_url="http://127.0.0.1:9/v1")
LEASE_S = 2.0
VIDEO = {"prompt": "waves on a beach", "seconds": "4", "size": "128x64", "num_inference_steps": 2}


def hook_and_job(server: ServerProcess, rx: Receiver) -> tuple[str, str]:
    """An endpoint for the receiver and a job on `server`: (the endpoint's secret, the video id)."""
    with httpx.Client(base_url=server.url, timeout=30) as client:
        made = client.post("/v1/webhook_endpoints", json={"name": "durable", "url": rx.url,
                                                          "event_types": ["video.completed"]})
        assert made.status_code == 200, made.text
        video = client.post("/v1/videos", json=VIDEO)
        assert video.status_code == 200, video.text
    return made.json()["signing_secret"], video.json()["id"]


def delivered_once_more(rx: Receiver, secret: str, video_id: str) -> None:
    """The receiver got the hung attempt and one more, the same event under the same webhook-id, both verified."""
    first, second = rx.wait_for(2, timeout_s=30)
    assert first.headers["webhook-id"] == second.headers["webhook-id"] and first.body == second.body
    event = SDK.webhooks.unwrap(second.body, second.headers, secret=secret)
    assert (event.type, event.data.id) == ("video.completed", video_id)


def test_a_delivery_survives_kill_9_and_the_restart_sends_it(tmp_path):
    data_dir = tmp_path / "data"
    with receiver() as rx:
        rx.answer(HANG)  # the first attempt hangs: the server dies between the job's end and the delivery
        victim = start_process(data_dir, rx.host)
        try:
            secret, video_id = hook_and_job(victim, rx)
            rx.wait_for(1)
            victim.kill()
        finally:
            victim.stop()
        rx.release()  # its answer goes nowhere: the delivery was never recorded
        with serve_webhooks(data_dir, api_key=None, webhook_allow_hosts=(rx.host,)) as restarted:  # same SQLite
            delivered_once_more(rx, secret, video_id)
            with restarted.client() as client:
                view = wait_until(lambda: (d := client.get(f"/v1/videos/{video_id}/webhook_deliveries").json()
                                           ["data"][0])["state"] == "delivered" and d, what="the delivery recorded")
            assert view["attempts"] == 2 and view["id"] == rx.received[0].headers["webhook-id"]


def test_another_server_on_postgresql_takes_over_a_dead_servers_delivery(tmp_path, postgres_url):
    data_dir = tmp_path / "shared"
    with receiver() as rx:
        rx.answer(HANG)
        victim = start_process(data_dir, rx.host, job_store=postgres_url, lease_s=LEASE_S)
        try:
            secret, video_id = hook_and_job(victim, rx)
            rx.wait_for(1)  # the victim holds the delivery's lease, its attempt hanging: read it, then kill the victim
            with psycopg.connect(postgres_url) as db:
                row = db.execute("SELECT owner, lease_expires_at FROM webhook_deliveries").fetchone()
            owner, lease_expires_at = row
            assert int(owner.split(":")[1]) == victim.proc.pid
            victim.kill()
            rx.release()
            with serve_webhooks(data_dir, job_store=postgres_url, api_key=None, job_lease_s=LEASE_S,
                                webhook_allow_hosts=(rx.host,)) as survivor, psycopg.connect(postgres_url) as db:
                assert survivor.manager.owner != owner
                delivered_once_more(rx, secret, video_id)
                # The survivor took the delivery over only once the dead server's lease had run out.
                assert int(rx.received[1].headers["webhook-timestamp"]) >= int(lease_expires_at)
                wait_until(lambda: db.execute("SELECT state FROM webhook_deliveries").fetchone()[0] == "delivered",
                           what="the delivery recorded")
                assert db.execute("SELECT COUNT(*), MAX(attempts) FROM webhook_deliveries").fetchone() == (1, 2)
                time.sleep(0.3)  # the survivor's worker polls on: nothing is sent a third time
                assert len(rx.received) == 2
        finally:
            victim.stop()
