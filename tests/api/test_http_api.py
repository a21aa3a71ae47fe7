"""The HTTP API over the real app, store and job manager, with a fake engine (fast): bodies, errors, limits,
the job lifecycle, cancellation, the queue bound, /sync, metrics."""

from __future__ import annotations

import base64
import io
import json

import httpx
import pytest
from fake_executor import CLIENT_FAIL_PROMPT, CRASH_PROMPT, FAIL_PROMPT, TIMEOUT_PROMPT, FakeExecutor
from fastapi.testclient import TestClient
from PIL import Image
from prometheus_client.parser import text_string_to_metric_families
from waiting import wait_until

from h3serve.api.app import create_app
from h3serve.api.server_config import ServerConfig
from h3serve.engine.jobs import JobManager
from h3serve.jobstore.job_files import JobFiles
from h3serve.jobstore.sqlite import SQLiteJobStore
from h3serve.rules.names import SAMPLE_SOLVERS

JOB_FIELDS = {
    "id", "object", "model", "status", "progress", "created_at", "completed_at", "expires_at", "prompt", "size",
    "seconds", "remixed_from_video_id", "error", "num_frames", "fps", "duration_s", "stage_durations", "stage_timeline",
    "peak_memory_mb", "inference_time_s", "progress_steps", "num_outputs", "outputs",
}
REQUEST = {"prompt": "waves on a beach", "size": "128x64", "seconds": "4", "num_inference_steps": 2, "seed": 5}


@pytest.fixture
def client(fake_server):
    with fake_server.client() as c:
        yield c


def multipart(fields: dict, files: list | None = None) -> list:
    """httpx `files=` entries that send every field as a multipart text part (as the OpenAI SDK does)."""
    parts = [(k, (None, v if isinstance(v, str) else json.dumps(v))) for k, v in fields.items()]
    return parts + (files or [])


def wait_finished(client: httpx.Client, video_id: str, timeout_s: float = 30) -> dict:
    def finished() -> dict | None:
        job = client.get(f"/v1/videos/{video_id}").json()
        return job if job["status"] in ("completed", "failed") else None

    return wait_until(finished, timeout_s, f"{video_id} to finish", 0.02)


def wait_status(client: httpx.Client, video_id: str, status: str, timeout_s: float = 10) -> None:
    wait_until(lambda: client.get(f"/v1/videos/{video_id}").json()["status"] == status, timeout_s,
               f"{video_id} to reach {status}", 0.02)


def assert_error(response: httpx.Response, status: int, code: str, param: str | None = None) -> str:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["code"], error["param"]) == (code, param)
    assert "Traceback" not in error["message"] and "/tmp" not in error["message"]
    return error["message"]


def png(width: int = 256, height: int = 256) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (width, height), (200, 80, 20)).save(buf, format="PNG")
    return buf.getvalue()


# -- bodies -----------------------------------------------------------------------------------------------------


def test_multipart_urlencoded_and_json_bodies_make_the_same_job(client, fake_server):
    as_form = {**{k: str(v) for k, v in REQUEST.items()}, "extra_params": '{"audio_flow_shift": 2}'}
    bracketed = {k: v for k, v in as_form.items() if k != "extra_params"} | {"extra_params[audio_flow_shift]": "2"}
    responses = [
        client.post("/v1/videos", files=multipart(as_form)),
        client.post("/v1/videos", data=as_form),
        client.post("/v1/videos", json={**REQUEST, "extra_params": {"audio_flow_shift": 2}}),
        client.post("/v1/videos", files=multipart(bracketed)),  # how the SDK sends extra_body
    ]
    jobs = []
    for response in responses:
        assert response.status_code == 200, response.text
        job = response.json()
        assert set(job) == JOB_FIELDS
        assert (job["object"], job["status"], job["progress"], job["model"]) == ("video", "queued", 0, "tiny")
        assert (job["size"], job["seconds"], job["num_frames"], job["fps"]) == ("128x64", "4", 107, 24)
        jobs.append(job)
    stored = [fake_server.store.get(j["id"]).request for j in jobs]
    assert all(r == stored[0] for r in stored) and stored[0].audio_flow_shift == 2.0 and stored[0].steps == 2
    videos = []
    for job in jobs:
        assert wait_finished(client, job["id"])["status"] == "completed"
        videos.append(client.get(f"/v1/videos/{job['id']}/content").content)
    assert all(v == videos[0] for v in videos)  # same request, same (deterministic) output


def test_progress_steps_count_the_forwards_of_every_generated_window(client):
    """The page names the step of a long video's whole run: progress counts steps x windows (16 s in 107-frame
    windows: 396 frames, 5 windows), one bar from 0 to 100."""
    plain = client.post("/v1/videos", json=REQUEST).json()
    long = client.post("/v1/videos", json={**REQUEST, "size": "32x32", "seconds": "16", "long_video": True,
                                           "long_video_mode": "continuation", "continuation_window_frames": 107})
    assert long.status_code == 200, long.text
    assert (plain["progress_steps"], long.json()["progress_steps"], long.json()["num_frames"]) == (2, 10, 396)
    assert client.delete(f"/v1/videos/{long.json()['id']}").status_code == 200
    assert wait_finished(client, plain["id"])["progress_steps"] == 2


def test_job_lifecycle_and_downloads(client):
    created = client.post("/v1/videos", json=REQUEST).json()
    retrieved = client.get(f"/v1/videos/{created['id']}")
    assert retrieved.headers["openai-poll-after-ms"] == "50"
    job = wait_finished(client, created["id"])
    assert (job["status"], job["progress"], job["error"]) == ("completed", 100, None)
    assert job["completed_at"] >= job["created_at"] and job["expires_at"] == job["completed_at"] + 3600
    assert job["duration_s"] == pytest.approx(107 / 24) and job["peak_memory_mb"] == 12.5
    assert {"denoise", "encode"} <= set(job["stage_durations"])
    assert [span["stage"] for span in job["stage_timeline"]] == ["denoise", "encode"]
    assert all(0 <= span["start_s"] <= span["end_s"] for span in job["stage_timeline"])

    expected = {"video": ("video/mp4", "mp4"), "thumbnail": ("image/webp", "webp"),
                "spritesheet": ("image/jpeg", "jpg")}
    for variant, (media_type, extension) in expected.items():
        response = client.get(f"/v1/videos/{job['id']}/content", params={"variant": variant},
                              headers={"Accept": "application/binary"})
        assert response.status_code == 200
        assert response.headers["content-type"] == media_type
        assert f'filename="{job["id"]}.{extension}"' in response.headers["content-disposition"]
    assert client.get(f"/v1/videos/{job['id']}/content").content[4:8] == b"ftyp"

    assert client.delete(f"/v1/videos/{job['id']}").json() == {"id": job["id"], "object": "video.deleted",
                                                               "deleted": True}
    assert_error(client.get(f"/v1/videos/{job['id']}"), 404, "video_not_found", "video_id")
    assert_error(client.get(f"/v1/videos/{job['id']}/content"), 404, "video_not_found", "video_id")
    assert_error(client.delete(f"/v1/videos/{job['id']}"), 404, "video_not_found", "video_id")


def test_keyframe_upload_is_stored_with_the_job(client, fake_server):
    image = png()
    response = client.post("/v1/videos", files=multipart(
        {"prompt": "a fox", "seconds": "4", "num_inference_steps": "1"},
        [("input_reference", ("fox.png", image, "image/png"))],
    ))
    assert response.status_code == 200, response.text
    job = response.json()
    request = fake_server.store.get(job["id"]).request
    assert request.image is not None and request.references == ()
    assert (request.image.name, request.image.kind) == ("fox.png", "image")
    assert request.image.path.read_bytes() == image
    assert fake_server.files.job_dir(job["id"]) in request.image.path.parents
    assert job["size"] == "64x64"  # the canvas follows the keyframe's aspect ratio
    assert wait_finished(client, job["id"])["status"] == "completed"


# -- errors and limits --------------------------------------------------------------------------------------------


def test_errors_use_the_openai_envelope(client, fake_server):
    message = assert_error(client.post("/v1/videos", json={**REQUEST, "colour": "red"}), 400, "unknown_field",
                           "colour")
    assert "colour" in message
    message = assert_error(client.post("/v1/videos", data={**REQUEST, "seconds": "20"}), 400, "invalid_value",
                           "seconds")
    assert message.startswith("seconds: must be between 4 and 15")
    assert_error(client.post("/v1/videos", json={**REQUEST, "num_inference_steps": 500}), 400, "invalid_value",
                 "num_inference_steps")
    assert_error(client.post("/v1/videos", json={**REQUEST, "model": "sora-2"}), 400, "model_not_found", "model")
    assert_error(client.post("/v1/videos", content=b"{oops", headers={"Content-Type": "application/json"}), 400,
                 "invalid_json")
    assert_error(client.post("/v1/videos", content=b"prompt", headers={"Content-Type": "text/plain"}), 415,
                 "unsupported_media_type")
    assert_error(client.get("/v1/videos", params={"limit": 101}), 400, "invalid_value", "limit")
    assert_error(client.get("/v1/videos/video_nope/content", params={"variant": "gif"}), 400, "invalid_value",
                 "variant")
    assert_error(client.get("/v1/videos/video_nope"), 404, "video_not_found", "video_id")
    assert_error(client.get("/v1/nothing-here"), 404, "not_found")
    assert fake_server.files.job_ids() <= fake_server.store.ids()  # refused requests left no folders behind


def test_limit_zero_is_an_empty_page_as_vllm_omni_answers(client, fake_server):
    """vLLM-Omni (its tests assert it) answers `limit=0` with 200 and no data; has_more says whether any job is
    listed (issue 30 item 5). Below 0 and above 100 stay 400."""
    created = client.post("/v1/videos", json=REQUEST).json()
    page = client.get("/v1/videos", params={"limit": 0})
    assert page.status_code == 200, page.text
    assert page.json() == {"object": "list", "data": [], "first_id": None, "last_id": None, "has_more": True}
    after_last = client.get("/v1/videos", params={"limit": 0, "after": created["id"], "order": "asc"}).json()
    assert (after_last["data"], after_last["has_more"]) == ([], False)  # nothing listed after the newest
    assert_error(client.get("/v1/videos", params={"limit": -1}), 400, "invalid_value", "limit")
    spec = httpx.get(f"{fake_server.url}/openapi.json").json()
    limit = next(p for p in spec["paths"]["/v1/videos"]["get"]["parameters"] if p["name"] == "limit")
    assert (limit["schema"]["minimum"], limit["schema"]["maximum"], limit["schema"]["default"]) == (0, 100, 20)
    wait_finished(client, created["id"])


def test_sample_solver_reaches_the_plan_and_a_bad_one_is_a_400_naming_it(client, fake_server):
    for form in ({"json": {**REQUEST, "extra_params": {"sample_solver": " RES_multistep"}}},
                 {"data": {**REQUEST, "extra_params[sample_solver]": "res_multistep"}}):
        job = wait_finished(client, client.post("/v1/videos", **form).json()["id"])
        assert job["status"] == "completed"
        assert fake_server.executor.plans[-1].sample_solver == "res_multistep"
    bad = client.post("/v1/videos", json={**REQUEST, "extra_params": {"sample_solver": "dpm++"}})
    assert_error(bad, 400, "invalid_value", "extra_params.sample_solver")

def test_api_key_guards_every_v1_route(fake_server):
    with fake_server.client(key=None) as anonymous, fake_server.client(key="wrong") as wrong:
        for c in (anonymous, wrong):
            for method, path in (("GET", "/v1/videos"), ("POST", "/v1/videos"), ("GET", "/v1/models"),
                                 ("GET", "/v1/videos/video_x"), ("DELETE", "/v1/videos/video_x"),
                                 ("POST", "/v1/videos/sync"), ("GET", "/v1/videos/video_x/content")):
                response = c.request(method, path)
                assert_error(response, 401, "invalid_api_key")
                assert response.headers["www-authenticate"] == "Bearer"
        assert anonymous.get("/health").json() == {"status": "healthy"}
        assert anonymous.get("/metrics").status_code == 200
    with fake_server.client() as c:
        assert c.get("/v1/models").json()["data"][0]["id"] == "tiny"


def test_a_70_mb_body_is_refused_with_413(client, fake_server):
    big = b"\0" * (70 * 2**20)
    response = client.post("/v1/videos", files=multipart(REQUEST, [("input_reference", ("x.png", big, "image/png"))]))
    assert_error(response, 413, "request_too_large")

    def chunks():  # no Content-Length: counted while it streams
        for _ in range(70):
            yield b"\0" * 2**20

    response = client.post("/v1/videos", content=chunks(), headers={"Content-Type": "application/json"})
    assert_error(response, 413, "request_too_large")


def test_per_file_byte_limit(client, fake_server):
    image = png()[:64] + b"\0" * (31 * 2**20)  # PNG magic bytes: an image, over the 30 MiB image limit
    response = client.post("/v1/videos", files=multipart(REQUEST, [("input_reference", ("big.png", image))]))
    assert "30 MiB" in assert_error(response, 413, "file_too_large", "input_reference")
    assert fake_server.files.job_ids() <= fake_server.store.ids()


def test_deeply_nested_bodies_are_400(client, fake_server):
    deep = b'{"prompt": "p", "extra_params": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    response = client.post("/v1/videos", content=deep, headers={"Content-Type": "application/json"})
    assert "levels deep" in assert_error(response, 400, "invalid_json")
    bracketed = {**{k: str(v) for k, v in REQUEST.items()}, "extra_params" + "[a]" * 5000: "1"}
    assert_error(client.post("/v1/videos", data=bracketed), 400, "invalid_body", "extra_params")
    assert fake_server.files.job_ids() <= fake_server.store.ids()


def test_a_malformed_media_url_is_400(client, fake_server):
    for url in ("http://[::1", "http://host:port/x.png", "https://xn--/x.png"):
        response = client.post("/v1/videos", json={**REQUEST, "image_reference": {"image_url": url}})
        assert "not a valid URL" in assert_error(response, 400, "invalid_media_url", "image_reference")
    assert fake_server.files.job_ids() <= fake_server.store.ids()


@pytest.fixture
def ref2va_only(fake_server):
    fake_server.executor.tasks = ("ref2va",)
    yield fake_server.executor
    fake_server.executor.tasks = ("t2va", "fl2va", "ref2va")


def test_a_task_the_loaded_dit_cannot_serve_is_400_before_queueing(client, fake_server, ref2va_only):
    stored = fake_server.store.ids()
    message = assert_error(client.post("/v1/videos", json=REQUEST), 400, "invalid_value", "task")
    assert "t2va is not served here" in message and "ref2va" in message
    response = client.post("/v1/videos", json={**REQUEST, "extra_params": {"task": "t2va"}})
    assert_error(response, 400, "invalid_value", "extra_params.task")
    assert_error(client.post("/v1/videos/sync", json=REQUEST), 400, "invalid_value", "task")
    assert fake_server.store.ids() == stored and fake_server.manager.queue_depth == 0


def test_reference_images_without_a_task_make_a_ref2va_job(client, fake_server):
    url = "data:image/png;base64," + base64.b64encode(png()).decode()
    response = client.post("/v1/videos", json={**REQUEST, "image_reference": [{"image_url": url}] * 3})
    assert response.status_code == 200, response.text
    request = fake_server.store.get(response.json()["id"]).request
    assert (request.image, len(request.references)) == (None, 3)
    assert wait_finished(client, response.json()["id"])["status"] == "completed"
    assert fake_server.executor.plans[-1].task == "ref2va"


def test_media_urls_to_loopback_are_refused(client):
    for url in ("http://127.0.0.1:8000/cat.png", "http://localhost/cat.png"):
        response = client.post("/v1/videos", json={**REQUEST, "image_reference": {"image_url": url}})
        assert "loopback" in assert_error(response, 400, "invalid_media_url", "image_reference")


# -- queue, cancellation, failures ----------------------------------------------------------------------------------


@pytest.fixture
def slow_engine(fake_server):
    fake_server.executor.step_s = 0.05
    yield fake_server.executor
    fake_server.executor.step_s = 0.01


def test_queue_full_is_429_with_retry_after(client, fake_server, slow_engine):
    running = client.post("/v1/videos", json={**REQUEST, "num_inference_steps": 200}).json()
    wait_status(client, running["id"], "in_progress")
    queued = [client.post("/v1/videos", json=REQUEST).json()["id"] for _ in range(fake_server.config.max_queue)]
    response = client.post("/v1/videos", json=REQUEST)
    assert_error(response, 429, "queue_full")
    assert int(response.headers["retry-after"]) >= 1
    assert_error(client.post("/v1/videos/sync", json=REQUEST), 429, "queue_full")
    for video_id in [running["id"], *queued]:
        assert client.delete(f"/v1/videos/{video_id}").status_code == 200
    assert client.post("/v1/videos", json=REQUEST).status_code == 200  # room again


def test_deleting_a_running_job_stops_it_at_the_next_step(client, fake_server, slow_engine):
    stops = len(slow_engine.cancelled_at)
    running = client.post("/v1/videos", json={**REQUEST, "num_inference_steps": 200}).json()
    wait_status(client, running["id"], "in_progress")
    assert_error(client.get(f"/v1/videos/{running['id']}/content"), 409, "video_not_ready")
    assert client.delete(f"/v1/videos/{running['id']}").status_code == 200
    # Jobs deleted by an earlier test may still be stopping: this one is the 200-step job.
    wait_until(lambda: any(t == 200 for _, t in slow_engine.cancelled_at[stops:]), 5, "the running job to stop")
    step, total = next((s, t) for s, t in slow_engine.cancelled_at[stops:] if t == 200)
    assert step < total
    assert_error(client.get(f"/v1/videos/{running['id']}"), 404, "video_not_found", "video_id")
    assert wait_finished(client, client.post("/v1/videos", json=REQUEST).json()["id"])["status"] == "completed"


def test_a_failed_job_reports_its_error(client):
    job = wait_finished(client, client.post("/v1/videos", json={**REQUEST, "prompt": FAIL_PROMPT}).json()["id"])
    assert job["status"] == "failed" and job["error"]["code"] == "generation_failed"
    assert "asked to fail" in job["error"]["message"]
    assert_error(client.get(f"/v1/videos/{job['id']}/content"), 422, "video_failed")


# -- /sync -------------------------------------------------------------------------------------------------------


def test_sync_returns_the_mp4_with_measurement_headers(client):
    response = client.post("/v1/videos/sync", files=multipart({
        "prompt": "waves on a beach", "width": "128", "height": "64", "fps": "24", "num_inference_steps": "2",
        "flow_shift": "12", "seed": "42", "extra_params": '{"task": "t2va", "duration": 4}',
    }))
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "video/mp4" and response.content[4:8] == b"ftyp"
    video_id = response.headers["x-request-id"]
    assert video_id.startswith("video_") and response.headers["x-model"] == "tiny"
    assert float(response.headers["x-inference-time-s"]) > 0
    assert "denoise" in json.loads(response.headers["x-stage-durations"])
    assert response.headers["x-peak-memory-mb"] == "12.500"
    assert client.get(f"/v1/videos/{video_id}").status_code == 404  # a sync job lives as long as its request
    assert video_id not in [v["id"] for v in client.get("/v1/videos", params={"limit": 100}).json()["data"]]


@pytest.mark.parametrize(
    "prompt, status, code",
    [
        (CLIENT_FAIL_PROMPT, 400, "invalid_request"),  # the request was at fault, found only at run time
        (FAIL_PROMPT, 500, "generation_failed"),
        (TIMEOUT_PROMPT, 500, "internal_error"),
        (CRASH_PROMPT, 500, "internal_error"),
    ],
)
def test_sync_failures_are_4xx_only_when_the_request_was_at_fault(client, prompt, status, code):
    response = client.post("/v1/videos/sync", json={**REQUEST, "prompt": prompt})
    message = assert_error(response, status, code)
    assert "secret" not in message  # an unexpected exception's text never reaches the client
    assert client.get(f"/v1/videos/{response.headers['x-request-id']}").status_code == 404


def test_sync_timeout_is_504_and_aborts_the_job(client, fake_server, slow_engine):
    stops = len(slow_engine.cancelled_at)
    response = client.post("/v1/videos/sync", json={**REQUEST, "num_inference_steps": 200})
    assert "timed out after 2 s" in assert_error(response, 504, "timeout")
    wait_until(lambda: len(slow_engine.cancelled_at) > stops, 5, "the timed-out job to stop")
    assert_error(client.get(f"/v1/videos/{response.headers['x-request-id']}"), 404, "video_not_found", "video_id")


# -- metrics, docs, page -----------------------------------------------------------------------------------------


def test_metrics_report_queue_states_and_stage_latencies(client, fake_server):
    wait_finished(client, client.post("/v1/videos", json=REQUEST).json()["id"])
    samples = scrape(httpx.get(f"{fake_server.url}/metrics").text)
    assert samples["h3serve_queue_depth", ()] == 0
    completed = fake_server.store.count_by_status()["completed"]
    assert samples["h3serve_jobs", (("state", "completed"),)] == completed
    assert samples["h3serve_stage_duration_seconds_bucket", (("le", "+Inf"), ("stage", "denoise"))] >= 1
    assert samples["h3serve_job_duration_seconds_count", (("status", "completed"),)] >= 1
    assert samples["h3serve_engine_up", ()] == 1


def test_openapi_and_web_page(fake_server):
    spec = httpx.get(f"{fake_server.url}/openapi.json").json()
    create = spec["paths"]["/v1/videos"]["post"]
    assert set(create["requestBody"]["content"]) == {"multipart/form-data", "application/x-www-form-urlencoded",
                                                     "application/json"}
    assert {"/v1/videos/sync", "/v1/videos/{video_id}/content", "/health", "/metrics"} <= set(spec["paths"])
    for content in create["requestBody"]["content"].values():  # steps are denoiser forwards, in every body
        steps = content["schema"]["properties"]["num_inference_steps"]
        assert "denoiser forwards" in steps["description"] and "N + 1" in steps["description"]
        assert (steps["minimum"], steps["maximum"]) == (1, 200)
    solver = create["requestBody"]["content"]["application/json"]["schema"]["properties"]["extra_params"][
        "properties"]["sample_solver"]
    assert solver["examples"] == list(SAMPLE_SOLVERS) and "res_multistep" in solver["pattern"]
    assert "euler (default)" in solver["description"]
    page = httpx.get(fake_server.url + "/")
    assert page.status_code == 200 and "text/html" in page.headers["content-type"] and "/v1/videos" in page.text


def test_health_and_metrics_show_each_replica(tmp_path):
    config = ServerConfig(served_model_name="tiny", data_dir=tmp_path).validate()
    store = SQLiteJobStore(config.store_path)
    replicas = [FakeExecutor(), FakeExecutor()]
    manager = JobManager(replicas, store, JobFiles(config.jobs_dir), model_name=config.served_model_name)
    try:
        with TestClient(create_app(config, manager, store)) as client:
            replicas[1].closed = True  # its ranks are gone: the other replica still serves
            health = client.get("/health")
            assert health.status_code == 200 and [r["healthy"] for r in health.json()["replicas"]] == [True, False]
            assert "not running" in health.json()["replicas"][1]["reason"]
            samples = scrape(client.get("/metrics").text)
            assert samples["h3serve_replica_up", (("replica", "0"),)] == 1
            assert samples["h3serve_replica_up", (("replica", "1"),)] == 0
            assert samples["h3serve_replica_jobs_served_total", (("replica", "1"),)] == 0
            replicas[0].closed = True
            assert client.get("/health").status_code == 503
    finally:
        store.close()


def scrape(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """A /metrics exposition as Prometheus reads it: (sample name, sorted labels) -> value."""
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


# -- several outputs of one prompt ----------------------------------------------------------------------------------


def test_a_job_of_several_outputs_lists_and_serves_each(client):
    job = client.post("/v1/videos", json={**REQUEST, "num_outputs_per_prompt": 3}).json()
    assert job["num_outputs"] == 3 and job["progress_steps"] == 3 * REQUEST["num_inference_steps"]
    done = wait_finished(client, job["id"])
    assert done["status"] == "completed"
    assert [o["index"] for o in done["outputs"]] == [0, 1, 2]
    videos = [client.get(o["url"]) for o in done["outputs"]]
    assert all(v.status_code == 200 and v.headers["content-type"] == "video/mp4" for v in videos)
    assert len({v.content for v in videos}) == 3  # seeds 5, 6, 7: three different videos
    assert videos[0].content == client.get(f"/v1/videos/{job['id']}/content").content  # index 0 is the default
    assert 'filename="' + job["id"] + '-2.mp4"' in videos[2].headers["content-disposition"]
    thumb = client.get(f"/v1/videos/{job['id']}/content", params={"variant": "thumbnail", "index": 1})
    assert thumb.status_code == 200 and thumb.headers["content-type"] == "image/webp"
    assert "0 to 2" in assert_error(client.get(f"/v1/videos/{job['id']}/content?index=3"), 404, "output_not_found",
                                    "index")
    assert_error(client.get(f"/v1/videos/{job['id']}/content?index=10"), 400, "invalid_value", "index")
    # Output i is the single request at seed + i.
    single = wait_finished(client, client.post("/v1/videos", json={**REQUEST, "seed": 7}).json()["id"])
    assert single["outputs"] == [{"index": 0, "url": f"/v1/videos/{single['id']}/content?index=0"}]
    assert client.get(f"/v1/videos/{single['id']}/content").content == videos[2].content


def test_the_outputs_count_takes_its_openai_name_and_is_checked(client):
    job = client.post("/v1/videos", files=multipart({**REQUEST, "n": "2"})).json()
    assert job["num_outputs"] == 2
    wait_finished(client, job["id"])
    for bad in (0, 11, True, 1.5, "two"):
        assert_error(client.post("/v1/videos", json={**REQUEST, "num_outputs_per_prompt": bad}), 400,
                     "invalid_value", "num_outputs_per_prompt")
    assert_error(client.post("/v1/videos", json={**REQUEST, "n": 0}), 400, "invalid_value", "n")
    message = assert_error(client.post("/v1/videos", json={**REQUEST, "seed": 2**63 - 2, "n": 3}), 400,
                           "invalid_value", "n")
    assert "largest seed" in message


def test_sync_returns_output_zero_and_says_how_many(client):
    response = client.post("/v1/videos/sync", json={**REQUEST, "num_outputs_per_prompt": 2})
    assert response.status_code == 200 and response.headers["x-num-outputs"] == "2"
    single = client.post("/v1/videos/sync", json=REQUEST)
    assert single.headers["x-num-outputs"] == "1" and single.content == response.content


def test_a_job_counts_its_outputs_toward_the_queue_bound(client, fake_server, slow_engine):
    running = client.post("/v1/videos", json={**REQUEST, "num_inference_steps": 200}).json()
    wait_status(client, running["id"], "in_progress")
    three = client.post("/v1/videos", json={**REQUEST, "n": 3}).json()["id"]  # 3 of max_queue 4
    assert_error(client.post("/v1/videos", json={**REQUEST, "n": 2}), 429, "queue_full")
    one = client.post("/v1/videos", json=REQUEST).json()["id"]  # the fourth
    for video_id in (running["id"], three, one):
        assert client.delete(f"/v1/videos/{video_id}").status_code == 200
    assert client.post("/v1/videos", json={**REQUEST, "n": 10}).status_code == 200  # an empty queue takes any job


def test_literal_video_paths_are_not_video_ids(client):
    """/v1/videos/sync, /edits and /extensions take POST only: OPTIONS says so and GET / DELETE there are 405s
    (they were read as a video id); the remix route documents its 415 for a body without a content type."""
    for path in ("/v1/videos/sync", "/v1/videos/edits", "/v1/videos/extensions"):
        options = client.options(path)
        assert options.status_code == 204 and options.headers["allow"] == "OPTIONS, POST", path
        for method in ("GET", "DELETE"):
            response = client.request(method, path)
            assert response.status_code == 405 and response.headers["allow"] == "OPTIONS, POST", (method, path)
    assert client.options("/v1/videos/video_" + "0" * 32).headers["allow"] == "DELETE, GET, OPTIONS"
    remix = client.get("/openapi.json").json()["paths"]["/v1/videos/{video_id}/remix"]["post"]["responses"]
    assert "415" in remix
