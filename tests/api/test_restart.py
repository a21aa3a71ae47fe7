"""Durability: SIGKILL the server mid-job, start it again on the same data dir, and every job completes once."""

from __future__ import annotations

import httpx
from api_servers import start_live_server
from waiting import wait_until

from h3serve.media.output_probe import check_output_contract, probe

REQUEST = {"prompt": "rain on a tin roof", "seconds": "4", "size": "128x64", "num_inference_steps": 1}


def job(client: httpx.Client, video_id: str) -> dict:
    response = client.get(f"/v1/videos/{video_id}")
    assert response.status_code == 200, response.text
    return response.json()


def in_state(client: httpx.Client, video_id: str, *states: str) -> dict | None:
    current = job(client, video_id)
    return current if current["status"] in states else None


def test_sigkill_mid_job_then_restart_completes_every_job_once(tiny_checkpoint, tmp_path):
    data_dir = tmp_path / "data"
    first = start_live_server(tiny_checkpoint, data_dir)
    second = None
    try:
        with httpx.Client(base_url=first.url, timeout=30) as client:
            seeds = (1, 2, 1)  # the third repeats the first request: same output bytes expected
            ids = [client.post("/v1/videos", json={**REQUEST, "seed": s}).json()["id"] for s in seeds]
            done_before = wait_until(lambda: job(client, ids[0])["status"] == "completed" and job(client, ids[0]),
                                   120, "the first job")
            wait_until(lambda: job(client, ids[1])["status"] == "in_progress", 60, "the second job to start")
        first.kill()

        second = start_live_server(tiny_checkpoint, data_dir)
        with httpx.Client(base_url=second.url, timeout=30) as client:
            finished = [wait_until(lambda i=i: in_state(client, i, "completed", "failed"), 180, f"job {i}", 0.1)
                        for i in ids]
            assert [j["status"] for j in finished] == ["completed"] * 3, finished
            assert finished[0]["completed_at"] == done_before["completed_at"]  # not run a second time
            listed = client.get("/v1/videos", params={"order": "asc", "limit": 100}).json()["data"]
            assert [v["id"] for v in listed] == ids  # none lost, none duplicated, original order
            videos = []
            for video_id in ids:
                response = client.get(f"/v1/videos/{video_id}/content")
                assert response.status_code == 200
                path = tmp_path / f"{video_id}.mp4"
                path.write_bytes(response.content)
                assert check_output_contract(probe(path)) == []
                videos.append(response.content)
            assert videos[0] == videos[2] and videos[0] != videos[1]  # deterministic across the restart
    finally:
        first.stop()
        if second is not None:
            second.stop()
