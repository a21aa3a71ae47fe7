"""WS /v1/realtime/video on the real engine: `h3serve serve` with the tiny checkpoint and a tiny streaming LoRA. A
30 s session is the same plan run offline in one process, in valid fragments with exact counts; a session streams
every frame with a prompt switch at a chunk boundary; a client that leaves mid-session frees the ranks, so the next
session runs in full."""

from __future__ import annotations

import json
import time

import pytest
import torch
from api_servers import start_live_server
from fmp4_media import decode, ffmpeg_errors, first_picture_is_key, split_init, top_boxes
from realtime_recorder import Recorder
from websockets.exceptions import InvalidStatus
from websockets.sync.client import ClientConnection, connect

from h3serve.config.engine_config import EngineConfig
from h3serve.media.fragments import FragmentWriter
from h3serve.rank.model_runner import ModelRunner
from h3serve.rank.realtime_loop import generate_offline
from h3serve.rules.validate.realtime_plan import plan_realtime
from h3serve.tools.tiny.make_adapter import make_tiny_adapter

KEY = "live-realtime-key"
pytestmark = pytest.mark.slow  # a server with rank processes


PROMPT = "fireworks over a harbour"


@pytest.fixture(scope="module")
def lora(tmp_path_factory):
    return make_tiny_adapter(tmp_path_factory.mktemp("taomate") / "taomate", "taomate")


@pytest.fixture(scope="module")
def live(tiny_checkpoint, lora, tmp_path_factory):
    server = start_live_server(tiny_checkpoint, tmp_path_factory.mktemp("live-rt"), "--api-key", KEY,
                               "--realtime-lora", str(lora), "--task-type", "fl2va", "--threads", "1")
    yield server
    server.stop()


def open_session(url: str, busy_for_s: float = 60) -> ClientConnection:
    """A connection, retried while the server answers 429 (the replica still frees its ranks)."""
    deadline = time.monotonic() + busy_for_s
    while True:
        try:
            return connect(url.replace("http://", "ws://") + "/v1/realtime/video", legacy=True, max_size=2**25,
                           additional_headers={"Authorization": f"Bearer {KEY}"})
        except InvalidStatus as e:
            if e.response.status_code != 429 or time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def session(url: str, interact_after: int | None = None, leave_after: int | None = None, num_frames: int = 124):
    """(chunk metadata, segments, the last JSON message) of one session (124 frames: 4 chunks)."""
    ws = open_session(url)
    ws.send(json.dumps({"type": "session.start", "prompt": PROMPT, "width": 64, "height": 64,
                        "seed": 9, "num_frames": num_frames, "format": "m4s"}))
    metadata, segments = [], []
    while True:
        message = json.loads(ws.recv(300))
        if message["type"] == "video.chunk_metadata":
            metadata.append(message)
            segments.append(ws.recv(60))
            if len(segments) == interact_after:
                ws.send(json.dumps({"type": "session.interaction",
                                    "interaction": {"event_id": "e1", "event": {"prompt": "a quiet forest"}}}))
            if len(segments) == leave_after:
                ws.close()
                return metadata, segments, message
        elif message["type"] in ("session.done", "error"):
            ws.close()
            return metadata, segments, message


def test_a_30_s_session_is_the_offline_plan_in_valid_fragments_with_exact_counts(live, tiny_checkpoint, lora,
                                                                                 tmp_path):
    metadata, segments, last = session(live.url, num_frames=720)
    assert last["type"] == "session.done" and metadata[-1]["kind"] == "trailer"
    threads, offline = torch.get_num_threads(), Recorder()
    try:
        engine = ModelRunner(EngineConfig(model=tiny_checkpoint, threads=1, realtime_lora=str(lora), task_type="fl2va"))
        generate_offline(engine, plan_realtime(PROMPT, 64, 64, 9, 720, defaults=engine.defaults), offline)
    finally:
        torch.set_num_threads(threads)
    frames, audio = offline.arrays()
    media = [m for m in metadata if m["kind"] == "media"]
    assert [m["num_frames"] for m in media] == [len(f) for f in offline.frames]  # the same chunks, in order
    assert [m["num_audio_samples"] for m in media] == [len(a) for a in offline.audio]
    assert len(frames) >= 720 and sum(m["num_frames"] for m in metadata) == len(frames)  # whole requests
    _, first = split_init(segments[0])
    for fragment in [first, *segments[1 : len(media)]]:  # each a moof + mdat that starts on a key frame
        assert [kind for kind, _ in top_boxes(fragment)][:2] == [b"moof", b"mdat"]
        assert first_picture_is_key(fragment)
    path = tmp_path / "session.mp4"
    path.write_bytes(b"".join(segments))
    assert ffmpeg_errors(path) == ""
    decoded, pcm = decode(path)
    assert decoded.shape == frames.shape  # exact frame count
    assert 0 <= pcm.shape[1] - len(audio) < 1024  # exact samples, then under one AAC frame of zeros
    writer = FragmentWriter(64, 64)  # the server's writer, fed the offline run's chunks: the same bytes
    assert [writer.segment(f, a) for f, a in zip(offline.frames, offline.audio, strict=True)] == segments[: len(media)]


def test_a_session_on_the_real_engine(live, tmp_path):
    metadata, segments, last = session(live.url, interact_after=1)
    assert last["type"] == "session.done" and last["stopped"] is False
    assert [m["kind"] for m in metadata] == ["media"] * 4 + ["trailer"]
    started = [i for i, m in enumerate(metadata) if m["started_event_ids"] == ["e1"]]
    assert len(started) == 1 and started[0] >= 1  # at a boundary after the chunk that was sent
    path = tmp_path / "live.mp4"
    path.write_bytes(b"".join(segments))
    assert ffmpeg_errors(path) == ""
    frames, _ = decode(path)
    assert frames.shape == (124, 64, 64, 3) == (sum(m["num_frames"] for m in metadata), 64, 64, 3)


def test_a_client_that_leaves_frees_the_ranks(live):
    metadata, _, _ = session(live.url, leave_after=1)
    assert len(metadata) == 1
    metadata, _, last = session(live.url)  # the replica and its ranks were released: the next session runs
    assert last["type"] == "session.done" and [m["kind"] for m in metadata][-1] == "trailer"
