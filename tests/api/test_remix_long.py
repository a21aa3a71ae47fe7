"""Issue 20: remix of any finished video through the official SDK's videos.remix, long ones included (a 40 s
continuation and an extension longer than 15 s): the rule in h3serve/api/derived.py, on the HTTP server with the
fake engine (which records each plan), the remixed MP4's shape read back with ffprobe."""

from __future__ import annotations

import json
import subprocess
import warnings

import numpy as np
import openai
import pytest
from api_servers import API_KEY

from h3serve.api.derived import REMIX_NOISE

SMALL = {"num_inference_steps": 2, "size": "32x32"}
NOISE = float(np.float32(REMIX_NOISE))  # as stored in a mask


@pytest.fixture
def sdk(fake_server):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # the SDK marks every videos.* call deprecated
        yield openai.OpenAI(base_url=f"{fake_server.url}/v1", api_key=API_KEY, max_retries=0)


def finished(sdk, video):
    done = sdk.videos.poll(video.id, poll_interval_ms=50)
    assert (done.status, done.error) == ("completed", None), done.error
    return done


def mp4_shape(sdk, video_id: str, tmp_path) -> tuple[str, int]:
    path = tmp_path / f"{video_id}.mp4"
    sdk.videos.download_content(video_id).write_to_file(path)
    out = subprocess.run(["ffprobe", "-v", "error", "-select_streams", "v:0", "-show_entries",
                          "stream=width,height,nb_frames", "-of", "json", str(path)], capture_output=True, text=True,
                         check=True)
    stream = json.loads(out.stdout)["streams"][0]
    return f"{stream['width']}x{stream['height']}", int(stream["nb_frames"])


def plan_of(fake_server, prompt: str):
    return next(p for p in reversed(fake_server.executor.plans) if p.prompt == prompt)


@pytest.mark.slow  # two 974-frame MP4s: about a minute on the shared 2-core host
def test_a_40_s_continuation_is_remixed_by_rerunning_its_plan_over_the_source(sdk, fake_server, tmp_path):
    source = finished(sdk, sdk.videos.create(prompt="a sailboat", seconds="40", extra_body={
        **SMALL, "seed": 9, "long_video": True, "long_video_mode": "continuation",
        "continuation_prompts": json.dumps(["at dawn", "a storm", "lightning", "calm"])}))
    original = plan_of(fake_server, "a sailboat")
    remix = sdk.videos.remix(source.id, prompt="a pirate ship")
    assert (remix.remixed_from_video_id, remix.size, remix.seconds) == (source.id, "32x32", "40")
    done = finished(sdk, remix)
    assert done.remixed_from_video_id == source.id
    plan = plan_of(fake_server, "a pirate ship")
    assert plan.continuation and plan.windows == original.windows and len(plan.windows) == 4
    assert (plan.seed, plan.steps, plan.num_frames, original.num_frames) == (9, 2, 974, 974)
    assert plan.window_prompts == ("a pirate ship",) * 4  # the new prompt in every window
    assert plan.source_video is not None and plan.references == ()
    assert {float(plan.video_mask.array().min()), float(plan.video_mask.array().max())} == {NOISE}
    assert {float(plan.audio_mask.array().min()), float(plan.audio_mask.array().max())} == {NOISE}
    assert mp4_shape(sdk, remix.id, tmp_path) == ("32x32", 974)


def test_an_extension_longer_than_15_s_is_remixed_as_a_continuation_and_a_short_video_by_reference(
    sdk, fake_server, tmp_path
):
    base = finished(sdk, sdk.videos.create(prompt="a red ball", seconds="4", extra_body=SMALL))
    short = sdk.videos.remix(base.id, prompt="a blue ball")  # 4 s: Ref2VA with the MP4 as the reference
    finished(sdk, short)
    plan = plan_of(fake_server, "a blue ball")
    assert plan.task == "ref2va" and len(plan.references) == 1 and plan.source_video is None
    extension = finished(sdk, sdk.videos.extend(prompt="it rolls on", seconds="12", video=openai.NOT_GIVEN,
                                                extra_body={**SMALL, "video": {"id": base.id}}))
    assert extension.seconds == f"{396 / 24:g}"  # 107 + 294 - 5 frames: 16.5 s
    remix = sdk.videos.remix(extension.id, prompt="a green ball", extra_body={"video_noise_mask": 0.6})
    assert (remix.remixed_from_video_id, remix.seconds) == (extension.id, extension.seconds)
    finished(sdk, remix)
    plan = plan_of(fake_server, "a green ball")
    assert plan.continuation and plan.extend_video is None and plan.num_frames == 396
    assert float(plan.video_mask.array().max()) == float(np.float32(0.6))  # the body's level wins
    assert float(plan.audio_mask.array().max()) == NOISE
    assert mp4_shape(sdk, remix.id, tmp_path) == ("32x32", 396)
