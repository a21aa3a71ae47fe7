"""`h3serve serve` on the tiny checkpoint, driven by the official OpenAI SDK and by plain multipart requests."""

from __future__ import annotations

import json
import threading
import time
import warnings
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
from api_servers import start_live_server

from h3serve.media.output_probe import check_output_contract, probe

KEY = "live-key"
SHORT = {"num_inference_steps": 1}  # one denoiser forward
# Mean |difference| (0-255) between a source's frames and an extension's first frames: a second H.264 encode of the
# tiny checkpoint's noise-like frames (5.4 measured); another video of the same size differs by far more.
EXTEND_TOLERANCE = 8.0


@pytest.fixture(scope="module")
def live(tiny_checkpoint, tmp_path_factory):
    # The cancellation test runs a deliberately long job (15 s, 200 steps): twice the default cost limit.
    server = start_live_server(tiny_checkpoint, tmp_path_factory.mktemp("live"), "--api-key", KEY,
                               "--poll-after-ms", "100", "--max-request-cost", "1e6")
    yield server
    server.stop()


@pytest.fixture
def sdk(live):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # the SDK marks every videos.* call deprecated
        yield openai.OpenAI(base_url=f"{live.url}/v1", api_key=KEY, max_retries=0)


def assert_valid_mp4(path: Path) -> None:
    problems = check_output_contract(probe(path))
    assert problems == [], problems


class HealthProbe:
    """Times GET /health every 0.2 s in a thread, to show the API answers while the engine works."""

    def __init__(self, url: str):
        self.url, self.latencies, self._stop = url, [], threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=10) as client:
            while not self._stop.is_set():
                start = time.monotonic()
                assert client.get(f"{self.url}/health").status_code == 200
                self.latencies.append(time.monotonic() - start)
                self._stop.wait(0.2)

    def __enter__(self) -> HealthProbe:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(15)


def test_openai_sdk_end_to_end(sdk, live, tmp_path):
    with HealthProbe(live.url) as health:
        # 40 steps: long enough on a fast host for the probe to sample the API many times while the job runs.
        video = sdk.videos.create_and_poll(prompt="waves on a beach", seconds="4", size="128x64",
                                           extra_body={**SHORT, "num_inference_steps": 40, "seed": 7})
    assert (video.status, video.progress, video.size, video.seconds, video.error) == (
        "completed", 100, "128x64", "4", None
    )
    assert len(health.latencies) >= 5 and max(health.latencies) < 1.0, health.latencies

    path = tmp_path / "video.mp4"
    sdk.videos.download_content(video.id).write_to_file(path)
    assert_valid_mp4(path)
    thumbnail = sdk.videos.download_content(video.id, variant="thumbnail")
    assert thumbnail.content[:4] == b"RIFF" and thumbnail.content[8:12] == b"WEBP"

    # Paging: three more jobs, newest first, two per page; then deleted (queued or running: cancelled).
    ids = [sdk.videos.create(prompt=f"clip {i}", seconds="4", size="128x64", extra_body=SHORT).id for i in range(3)]
    first_page = sdk.videos.list(limit=2)
    assert [v.id for v in first_page.data] == ids[::-1][:2] and first_page.has_more
    everything = [v.id for v in sdk.videos.list(limit=2)]  # the SDK follows `after` cursors
    assert everything == [*ids[::-1], video.id]
    assert [v.id for v in sdk.videos.list(order="asc", after=video.id, limit=100)] == ids
    for video_id in ids:
        deleted = sdk.videos.delete(video_id)
        assert (deleted.id, deleted.deleted, deleted.object) == (video_id, True, "video.deleted")
    assert [v.id for v in sdk.videos.list()] == [video.id]

    with pytest.raises(openai.BadRequestError) as bad:
        sdk.videos.create(prompt="too long", seconds="20")
    assert bad.value.param == "seconds" and bad.value.code == "invalid_value"
    with pytest.raises(openai.NotFoundError):
        sdk.videos.retrieve("video_" + "0" * 32)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{live.url}/v1", api_key="wrong", max_retries=0).videos.list()


def test_sdk_several_outputs_are_each_the_single_request(sdk, live):
    """The official SDK with num_outputs_per_prompt 2 (extra_body) on the real engine: the job lists both outputs;
    output 1 (extra_query index=1) is byte for byte the single request at seed + 1."""
    several = sdk.videos.create_and_poll(prompt="a lighthouse", seconds="4", size="128x64",
                                         extra_body={**SHORT, "seed": 20, "num_outputs_per_prompt": 2})
    assert several.status == "completed" and [o["index"] for o in several.model_extra["outputs"]] == [0, 1]
    single = sdk.videos.create_and_poll(prompt="a lighthouse", seconds="4", size="128x64",
                                        extra_body={**SHORT, "seed": 21})
    second = sdk.videos.download_content(several.id, extra_query={"index": 1}).content
    assert second == sdk.videos.download_content(single.id).content
    assert second != sdk.videos.download_content(several.id).content


def test_sync_multipart_example_request(live, tmp_path):
    fields = {
        "prompt": "A red fox trots through fresh snow at dawn",
        "width": "128",
        "height": "64",
        "fps": "24",
        "num_inference_steps": "1",
        "flow_shift": "12.0",
        "seed": "42",
        "extra_params": '{"task": "t2va", "duration": 4, "audio_flow_shift": 3.0}',
    }
    headers = {"Authorization": f"Bearer {KEY}"}
    response = httpx.post(f"{live.url}/v1/videos/sync", files={k: (None, v) for k, v in fields.items()},
                          headers=headers, timeout=300)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "video/mp4"
    assert response.headers["x-request-id"].startswith("video_")
    stages = json.loads(response.headers["x-stage-durations"])
    assert {"text_encode", "denoise", "video_decode", "audio_decode", "encode"} <= set(stages)
    assert float(response.headers["x-inference-time-s"]) > 0 and float(response.headers["x-peak-memory-mb"]) > 0
    path = tmp_path / "sync.mp4"
    path.write_bytes(response.content)
    assert_valid_mp4(path)

    bad = httpx.post(f"{live.url}/v1/videos/sync", files={**{k: (None, v) for k, v in fields.items()},
                                                          "fps": (None, "30")}, headers=headers, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "fps"


def _when_progress_reaches(sdk, video_id: str, percent: int) -> float:
    deadline = time.monotonic() + 120
    while (job := sdk.videos.retrieve(video_id)).progress < percent:
        assert job.status in ("queued", "in_progress") and time.monotonic() < deadline, job
        time.sleep(0.02)
    return time.monotonic()


def test_cancelling_a_running_job_frees_the_engine(sdk, live):
    # 15 s at 200 steps = 200 forwards; progress = done * 100 // 200 reaches 1 after 2 forwards, 2 after 4.
    long_job = sdk.videos.create(prompt="a long one", seconds="15", size="128x64",
                                 extra_body={"num_inference_steps": 200})
    reached_1 = _when_progress_reaches(sdk, long_job.id, 1)
    forward_s = (_when_progress_reaches(sdk, long_job.id, 2) - reached_1) / 2
    start = time.monotonic()
    sdk.videos.delete(long_job.id)
    short = sdk.videos.create_and_poll(prompt="next", seconds="4", size="128x64", extra_body=SHORT)
    elapsed = time.monotonic() - start
    assert short.status == "completed"
    remaining_s = (200 - 4) * forward_s  # what the long job still had to do, had it not stopped
    assert elapsed < remaining_s / 2, (elapsed, remaining_s)
    with pytest.raises(openai.NotFoundError):
        sdk.videos.retrieve(long_job.id)


def test_media_url_to_loopback_is_refused(live):
    response = httpx.post(
        f"{live.url}/v1/videos",
        json={"prompt": "x", "image_reference": {"image_url": f"{live.url}/health"}},
        headers={"Authorization": f"Bearer {KEY}"},
    )
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "image_reference"
    assert "loopback" in response.json()["error"]["message"]


def _frames(path: Path) -> np.ndarray:
    import av

    with av.open(str(path)) as container:
        return np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)]).astype(np.int16)


def test_sdk_remix_edit_and_extend(sdk, live, tmp_path):
    base = sdk.videos.create_and_poll(prompt="a red ball", seconds="4", size="64x64", extra_body={**SHORT, "seed": 1})
    assert base.status == "completed" and base.remixed_from_video_id is None
    source = tmp_path / "base.mp4"
    sdk.videos.download_content(base.id).write_to_file(source)
    upload = ("base.mp4", source.read_bytes(), "video/mp4")

    remix = sdk.videos.remix(base.id, prompt="a blue ball")
    assert (remix.remixed_from_video_id, remix.size, remix.seconds, remix.status) == (base.id, "64x64", "4", "queued")
    masked = sdk.videos.edit(prompt="a green ball", video=upload,
                             extra_body={**SHORT, "size": "64x64", "seconds": "4", "video_noise_mask": "0.5"})
    by_id = sdk.videos.edit(prompt="a green ball", video=openai.NOT_GIVEN, extra_body={"video": {"id": base.id}})
    assert (by_id.size, by_id.seconds) == ("64x64", "4")  # from the source job
    extended = sdk.videos.extend(prompt="the ball rolls on", seconds="4", video=upload,
                                 extra_body={**SHORT, "size": "64x64"})
    assert extended.seconds == f"{(107 + 102) / 24:g}"  # the source and the new part

    for job in (remix, masked, by_id, extended):
        done = sdk.videos.poll(job.id, poll_interval_ms=100)
        assert (done.status, done.progress, done.error) == ("completed", 100, None), done.error
    assert sdk.videos.retrieve(remix.id).remixed_from_video_id == base.id

    out = tmp_path / "extended.mp4"
    sdk.videos.download_content(extended.id).write_to_file(out)
    assert_valid_mp4(out)
    original, result = _frames(source), _frames(out)
    assert result.shape == (209, 64, 64, 3)
    # The first 107 frames are the source itself, through a second H.264 encode (x264 ultrafast, crf 18).
    assert np.abs(result[:107] - original).mean() < EXTEND_TOLERANCE
    other = tmp_path / "masked.mp4"
    sdk.videos.download_content(masked.id).write_to_file(other)
    assert np.abs(_frames(other) - original).mean() > 3 * EXTEND_TOLERANCE

    with pytest.raises(openai.BadRequestError) as bad:
        sdk.videos.extend(prompt="x", seconds="4", video=openai.NOT_GIVEN)
    assert bad.value.param == "video"
    with pytest.raises(openai.NotFoundError):
        sdk.videos.remix("video_" + "0" * 32, prompt="x")
