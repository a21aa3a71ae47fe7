"""Outputs in a bucket (the session's Ceph S3 gateway) behind the real app on a fake engine: the official SDK's round
trip, the same bytes as the data dir store, Range requests passed through, the 302 mode, several outputs and
previews, remix from the bucket, a missing object as a 404 with a reason, and DELETE and the TTL removing the
objects."""

from __future__ import annotations

import urllib.parse
from dataclasses import dataclass

import httpx
import openai
import pytest
from api_servers import API_KEY, FakeServer, serve_fake
from waiting import wait_until

PREFIX = "h3/outputs"
REQUEST = {"prompt": "waves on a beach", "size": "128x64", "seconds": "4", "num_inference_steps": 2, "seed": 11}
URL_TTL_S = 90


@dataclass
class Bucketed:
    server: FakeServer  # streams downloads from the bucket
    redirecting: FakeServer  # --output-redirect: 302 to a presigned URL
    bucket: str
    client: object  # the gateway's boto3 client (the test's own view of the bucket)

    def keys(self, job_id: str = "") -> list[str]:
        listed = self.client.list_objects_v2(Bucket=self.bucket, Prefix=f"{PREFIX}/{job_id}")
        return sorted(item["Key"].removeprefix(f"{PREFIX}/") for item in listed.get("Contents", []))

    def object(self, job_id: str, name: str) -> bytes:
        return self.client.get_object(Bucket=self.bucket, Key=f"{PREFIX}/{job_id}/{name}")["Body"].read()


@pytest.fixture(scope="module")
def bucketed(ceph_gateway, tmp_path_factory):
    bucket = ceph_gateway.new_bucket()
    with pytest.MonkeyPatch.context() as env:
        for name, value in ceph_gateway.credentials_env.items():
            env.setenv(name, value)
        store = {"output_store": f"s3://{bucket}/{PREFIX}", "s3_endpoint_url": ceph_gateway.endpoint_url}
        with serve_fake(tmp_path_factory.mktemp("bucketed"), **store) as server, \
                serve_fake(tmp_path_factory.mktemp("redirecting"), **store, output_redirect=True,
                           output_url_ttl_s=URL_TTL_S) as redirecting:
            yield Bucketed(server, redirecting, bucket, ceph_gateway.client())


def sdk(server: FakeServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)


def finished(client: httpx.Client, video_id: str) -> dict:
    def done() -> dict | None:
        job = client.get(f"/v1/videos/{video_id}").json()
        return job if job["status"] in ("completed", "failed") else None

    return wait_until(done, 30, f"{video_id} to finish", 0.02)


def test_sdk_round_trip_through_the_bucket_with_the_bytes_of_the_data_dir(bucketed, fake_server):
    client = sdk(bucketed.server)
    video = client.videos.create_and_poll(prompt=REQUEST["prompt"], seconds="4", size="128x64",
                                          extra_body={"num_inference_steps": 2, "seed": 11})
    assert video.status == "completed" and "upload" in video.model_extra["stage_durations"]
    assert bucketed.keys(video.id) == [f"{video.id}/{n}" for n in ("spritesheet.jpg", "thumbnail.webp", "video.mp4")]
    content = client.videos.download_content(video.id).content
    assert content == bucketed.object(video.id, "video.mp4")
    staged = bucketed.server.files.job_dir(video.id)
    assert not any(staged.glob("*.mp4")) and not (staged / ".staged.json").exists()  # the bucket holds them now
    with fake_server.client() as local:  # the same request on the data dir store: the same bytes
        local_job = finished(local, local.post("/v1/videos", json=REQUEST).json()["id"])
        assert local.get(f"/v1/videos/{local_job['id']}/content").content == content
        local_thumb = local.get(f"/v1/videos/{local_job['id']}/content", params={"variant": "thumbnail"}).content
    assert client.videos.download_content(video.id, variant="thumbnail").content == local_thumb
    sprite = client.videos.download_content(video.id, variant="spritesheet")
    assert sprite.response.headers["content-type"] == "image/jpeg" and sprite.content[:2] == b"\xff\xd8"
    with bucketed.server.client() as http:  # a sync job goes through the bucket too, and leaves nothing there
        sync = http.post("/v1/videos/sync", json=REQUEST)
    assert sync.status_code == 200 and sync.content == content and bucketed.keys(sync.headers["x-request-id"]) == []
    assert [v.id for v in client.videos.list()] == [video.id]
    assert client.videos.delete(video.id).deleted and bucketed.keys(video.id) == []
    with pytest.raises(openai.NotFoundError):
        client.videos.retrieve(video.id)


def test_range_requests_pass_through_to_the_bucket(bucketed):
    with bucketed.server.client() as client:
        job = finished(client, client.post("/v1/videos", json={**REQUEST, "seed": 12}).json()["id"])
        url = f"/v1/videos/{job['id']}/content"
        whole = client.get(url)
        size = len(whole.content)
        assert whole.status_code == 200 and whole.headers["accept-ranges"] == "bytes"
        assert int(whole.headers["content-length"]) == size and whole.headers["etag"]
        part = client.get(url, headers={"Range": "bytes=100-1099"})
        assert part.status_code == 206 and part.content == whole.content[100:1100]
        assert part.headers["content-range"] == f"bytes 100-1099/{size}" and part.headers["content-length"] == "1000"
        tail = client.get(url, headers={"Range": "bytes=-16"})
        assert tail.status_code == 206 and tail.content == whole.content[-16:]
        beyond = client.get(url, headers={"Range": f"bytes={size + 10}-"})
        assert beyond.status_code == 416 and beyond.headers["content-range"] == f"bytes */{size}"
        assert beyond.json()["error"]["code"] == "range_not_satisfiable"


def test_redirect_mode_answers_a_presigned_url_the_sdk_follows(bucketed):
    client = sdk(bucketed.redirecting)
    video = client.videos.create_and_poll(prompt="a lighthouse", seconds="4", size="128x64",
                                          extra_body={"num_inference_steps": 2, "seed": 13})
    with bucketed.redirecting.client() as http:
        answer = http.get(f"/v1/videos/{video.id}/content", params={"variant": "thumbnail"})
    assert answer.status_code == 302 and answer.headers["cache-control"] == "no-store"
    location = urllib.parse.urlsplit(answer.headers["location"])
    query = urllib.parse.parse_qs(location.query)
    assert location.path == f"/{bucketed.bucket}/h3/outputs/{video.id}/thumbnail.webp"
    assert query["X-Amz-Expires"] == [str(URL_TTL_S)] and query["response-content-type"] == ["image/webp"]
    direct = httpx.get(answer.headers["location"])  # no API key: the signature is the permission
    assert direct.status_code == 200 and direct.content == bucketed.object(video.id, "thumbnail.webp")
    assert client.videos.download_content(video.id).content == bucketed.object(video.id, "video.mp4")


def test_several_outputs_remix_missing_objects_and_expiry(bucketed):
    with bucketed.server.client() as client:
        job = finished(client, client.post("/v1/videos", json={**REQUEST, "num_outputs_per_prompt": 2}).json()["id"])
        names = ("spritesheet.jpg", "thumbnail.webp", "video.mp4")
        assert bucketed.keys(job["id"]) == sorted(f"{job['id']}/{p}{n}" for p in ("", "1.") for n in names)
        second = client.get(f"/v1/videos/{job['id']}/content", params={"index": 1})
        assert second.status_code == 200 and second.content == bucketed.object(job["id"], "1.video.mp4")

        remix = finished(client, client.post(f"/v1/videos/{job['id']}/remix", json={"prompt": "at night"}).json()["id"])
        assert remix["status"] == "completed" and remix["remixed_from_video_id"] == job["id"]

        bucketed.client.delete_object(Bucket=bucketed.bucket, Key=f"{PREFIX}/{job['id']}/video.mp4")  # behind our back
        missing = client.get(f"/v1/videos/{job['id']}/content")
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "file_not_found"
        assert "missing from the output store" in missing.json()["error"]["message"]
        again = client.post(f"/v1/videos/{job['id']}/remix", json={"prompt": "at dawn"})
        assert again.status_code == 404 and again.json()["error"]["param"] == "video_id"

        bucketed.server.store.update(remix["id"], expires_at=0)  # the output TTL ran out
        assert bucketed.server.manager.sweep_expired() == 1
        assert bucketed.keys(remix["id"]) == []
        expired = client.get(f"/v1/videos/{remix['id']}/content")
        assert expired.status_code == 404 and expired.json()["error"]["code"] == "video_expired"
