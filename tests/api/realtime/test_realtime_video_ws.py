"""WS /v1/realtime/video through the real server on a fake engine: a client written from vLLM-Omni's protocol
description (below, sharing nothing with the server's message classes) completes sessions; bad input of every kind
gets an `error` message and a clean close, never a traceback or a stuck session, and nothing leaks."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import httpx
import numpy as np
import pytest
from api_servers import API_KEY
from fake_realtime import FAIL_AT_PROMPT, STALL_PROMPT, FakeRealtimeExecutor, prompt_colour
from fmp4_media import decode, ffmpeg_errors, first_picture_is_key, split_init
from prometheus_client.parser import text_string_to_metric_families
from realtime_servers import serve_realtime
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import ClientConnection, connect

# -- the client: vLLM-Omni's serving_video_output_stream protocol, as its module docstring states it -------------
#   Client -> Server: {"type": "session.start", "prompt": ..., "format": "m4s", ...};
#     {"type": "session.interaction", "interaction": {"event_id", "event": {"prompt"}, "transition_chunks"?}};
#     {"type": "session.stop"}; {"type": "session.ping"}
#   Server -> Client: {"type": "video.start", "request_id", "config", "format": "m4s"};
#     {"type": "video.chunk_metadata", ...} then <binary frame: fragmented MP4 bytes>;
#     {"type": "session.interaction.queued", "request_id", "event_id"}; {"type": "session.done", ...};
#     {"type": "session.pong"}; {"type": "error", "message": ...}


@dataclass
class Received:
    start: dict
    metadata: list[dict] = field(default_factory=list)
    segments: list[bytes] = field(default_factory=list)
    other: list[dict] = field(default_factory=list)  # queued, pong, error
    done: dict | None = None

    def errors(self) -> list[dict]:
        return [m for m in self.other if m["type"] == "error"]


class StreamingVideoClient:
    def __init__(self, url: str, key: str | None = API_KEY):
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.ws: ClientConnection = connect(url, additional_headers=headers, open_timeout=10, max_size=2**25,
                                            legacy=True)

    def send(self, message: dict) -> None:
        self.ws.send(json.dumps(message))

    def start(self, **fields) -> dict:
        self.send({"type": "session.start", "format": "m4s", **fields})
        return self.next_json()

    def next_json(self, timeout: float = 10) -> dict:
        message = self.ws.recv(timeout)
        assert isinstance(message, str), "expected a JSON text message"
        return json.loads(message)

    def receive(self, start: dict, until_chunks: int | None = None, timeout: float = 20) -> Received:
        """Messages until session.done or an error (or `until_chunks` segments); each metadata's binary follows."""
        got = Received(start)
        while True:
            message = self.next_json(timeout)
            if message["type"] == "video.chunk_metadata":
                segment = self.ws.recv(timeout)
                assert isinstance(segment, bytes) and len(segment) == message["byte_length"]
                got.metadata.append(message)
                got.segments.append(segment)
                if until_chunks is not None and len(got.segments) >= until_chunks:
                    return got
            elif message["type"] == "session.done":
                got.done = message
                return got
            else:
                got.other.append(message)
                if message["type"] == "error":
                    return got

    def close_code(self, timeout: float = 10) -> int | None:
        """Waits for the server to close the connection; its close code."""
        deadline = time.monotonic() + timeout
        try:
            while time.monotonic() < deadline:
                self.ws.recv(deadline - time.monotonic())
        except ConnectionClosed:
            pass
        except TimeoutError:
            raise AssertionError("the server did not close the connection") from None
        return self.ws.close_code


# -- helpers -----------------------------------------------------------------------------------------------------

SESSION = {"prompt": "a lighthouse at dusk", "width": 64, "height": 64, "seed": 7, "num_frames": 124}  # 4 chunks


def wait_idle(server, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not server.idle():
        assert time.monotonic() < deadline, "the session's replica or engine was not released"
        time.sleep(0.02)


def chunk_colours(path) -> np.ndarray:
    frames, _ = decode(path)
    return frames[:, :, -8:].reshape(frames.shape[0], -1, 3).mean(axis=1)  # the prompt's colour, right edge


# -- sessions ----------------------------------------------------------------------------------------------------


def test_a_vllm_omni_client_completes_a_session(realtime_server, tmp_path):
    client = StreamingVideoClient(realtime_server.ws_url)
    start = client.start(**SESSION)
    assert start["type"] == "video.start" and start["format"] == "m4s" and start["request_id"]
    assert {k: start["config"][k] for k in ("prompt", "width", "height", "seed", "num_frames")} == SESSION
    got = client.receive(start)
    assert got.other == [] and got.done is not None
    kinds = [m["kind"] for m in got.metadata]
    assert kinds == ["media"] * 4 + ["trailer"]
    assert [m["transport_chunk_index"] for m in got.metadata] == list(range(5))
    assert [m["generation_chunk_index"] for m in got.metadata] == [0, 1, 2, 3, None]
    assert all(m["request_id"] == start["request_id"] for m in got.metadata)
    assert sum(m["num_frames"] for m in got.metadata) == 124
    assert sum(m["num_audio_samples"] for m in got.metadata) == 124 * 32000 // 24
    assert {m["audio_sample_rate"] for m in got.metadata} == {32000}
    assert got.done == {"type": "session.done", "request_id": start["request_id"], "chunks": 5, "stopped": False}
    assert client.close_code() == 1000
    # the segments: fragmented MP4 starting on key frames; their concatenation plays with every frame
    _, first = split_init(got.segments[0])
    assert all(first_picture_is_key(s) for s in [first, *got.segments[1:4]])
    path = tmp_path / "session.mp4"
    path.write_bytes(b"".join(got.segments))
    assert ffmpeg_errors(path) == ""
    frames, pcm = decode(path)
    assert frames.shape == (124, 64, 64, 3) and 124 * 32000 // 24 <= pcm.shape[1] < 124 * 32000 // 24 + 1024
    wait_idle(realtime_server)
    assert realtime_server.executor.streams[-1].closed


def test_a_new_prompt_takes_effect_at_a_chunk_boundary(realtime_server, tmp_path):
    client = StreamingVideoClient(realtime_server.ws_url)
    got = client.receive(client.start(**{**SESSION, "num_frames": 14_400}), until_chunks=1)
    client.send({"type": "session.interaction",
                 "interaction": {"event_id": "evt-1", "event": {"prompt": "a red fox in snow"}}})
    while not any(m["started_event_ids"] for m in got.metadata[-3:-2]):  # two chunks past the switch
        more = client.receive(got.start, until_chunks=1)
        got.metadata += more.metadata
        got.segments += more.segments
        got.other += more.other
    client.send({"type": "session.stop"})
    rest = client.receive(got.start)
    assert rest.done is not None and rest.done["stopped"] is True
    assert {"type": "session.interaction.queued", "request_id": got.start["request_id"], "event_id": "evt-1"} in \
        got.other + rest.other
    metadata, segments = got.metadata + rest.metadata, got.segments + rest.segments
    switch = next(i for i, m in enumerate(metadata) if m["started_event_ids"] == ["evt-1"])
    assert switch >= 1 and metadata[switch]["active_event_ids"] == ["evt-1"]
    assert metadata[switch]["completed_event_ids"] == ["evt-1"]
    assert all(m["started_event_ids"] == [] for i, m in enumerate(metadata) if i != switch)
    media = sum(m["kind"] == "media" for m in metadata)
    stream = realtime_server.executor.streams[-1]
    assert stream.prompts == [SESSION["prompt"]] * switch + ["a red fox in snow"] * (media - switch)
    # and the pictures: every frame before the boundary has the first prompt's colour, every one after the new one's
    path = tmp_path / "switch.mp4"
    path.write_bytes(b"".join(segments))
    colours = chunk_colours(path)
    boundary = sum(m["num_frames"] for m in metadata[:switch])
    assert np.abs(colours[:boundary] - prompt_colour(SESSION["prompt"])).max() < 6
    assert np.abs(colours[boundary:] - prompt_colour("a red fox in snow")).max() < 6
    assert client.close_code() == 1000
    wait_idle(realtime_server)


def test_ping_pong_and_stop_after_the_chunk_in_flight(realtime_server, tmp_path):
    client = StreamingVideoClient(realtime_server.ws_url)
    start = client.start(**{**SESSION, "num_frames": 14_400})  # ten minutes asked; stopped after the first chunk
    client.send({"type": "session.ping"})
    got = client.receive(start, until_chunks=1)
    client.send({"type": "session.stop"})
    rest = client.receive(start)
    assert {"type": "session.pong"} in got.other + rest.other
    kinds = [m["kind"] for m in got.metadata + rest.metadata]
    assert kinds[-1] == "trailer" and kinds.count("media") <= 3  # the chunk taken, at most one in flight
    assert rest.done == {"type": "session.done", "request_id": start["request_id"], "chunks": len(kinds),
                         "stopped": True}
    assert client.close_code() == 1000
    path = tmp_path / "stopped.mp4"
    path.write_bytes(b"".join(got.segments + rest.segments))
    assert ffmpeg_errors(path) == ""
    wait_idle(realtime_server)


def test_the_api_key_subprotocol_and_the_config_defaults(realtime_server):
    ws = connect(realtime_server.ws_url, subprotocols=["realtime", f"openai-insecure-api-key.{API_KEY}"],
                 legacy=True)
    assert ws.subprotocol == "realtime"
    ws.send(json.dumps({"type": "session.start", "prompt": "p", "size": "64x64", "seconds": "1",
                        "sampling_params": {"seed": 3, "guidance_scale": 1.0}}))
    start = json.loads(ws.recv(10))
    assert start["type"] == "video.start"
    assert {k: start["config"][k] for k in ("width", "height", "seed", "num_frames", "fps")} == \
        {"width": 64, "height": 64, "seed": 3, "num_frames": 24, "fps": 24}
    ws.close()
    wait_idle(realtime_server)


def test_an_interaction_id_used_twice_is_refused_and_the_session_goes_on(realtime_server):
    client = StreamingVideoClient(realtime_server.ws_url)
    start = client.start(**{**SESSION, "num_frames": 14_400})
    for _ in range(2):
        client.send({"type": "session.interaction", "interaction": {"event_id": "same", "event": {"prompt": "x"}}})
    got = client.receive(start, until_chunks=3)
    replies = [m for m in got.other if m["type"] in ("session.interaction.queued", "error")]
    assert replies[0]["type"] == "session.interaction.queued"
    assert replies[1]["type"] == "error" and replies[1]["code"] == "event_id_conflict"
    assert replies[1]["event_id"] == "same"
    client.ws.close()
    wait_idle(realtime_server)


# -- what is refused ---------------------------------------------------------------------------------------------

START = json.dumps({"type": "session.start", **SESSION})
BAD_STARTS = {
    "not JSON": ("{nope", "invalid_json", 1008),
    "not an object": ("[1, 2]", "invalid_message", 1008),
    "too large": (json.dumps({"type": "session.start", **SESSION, "prompt": "x" * (4 * 2**20)}),
                  "message_too_large", 1009),
    "not session.start first": ('{"type": "session.ping"}', "expected_session_start", 1008),
    "an unknown field": (json.dumps({"type": "session.start", **SESSION, "promt": "x"}), "invalid_message", 1008),
    "a wrong type": (json.dumps({"type": "session.start", **SESSION, "width": "wide"}), "invalid_message", 1008),
    "a format other than m4s": (json.dumps({"type": "session.start", **SESSION, "format": "mp4"}), "invalid_message",
                                1008),
    "a canvas the session refuses": (json.dumps({"type": "session.start", **SESSION, "width": 100}),
                                     "invalid_request", 1008),
    "another model": (json.dumps({"type": "session.start", **SESSION, "model": "other"}), "invalid_request", 1008),
    "a step count": (json.dumps({"type": "session.start", **SESSION, "num_inference_steps": 8}), "invalid_request",
                     1008),
    "binary": (b"\x00\x01", "binary_not_supported", 1003),
}


@pytest.mark.parametrize("case", list(BAD_STARTS))
def test_a_bad_start_gets_an_error_and_a_clean_close(realtime_server, case):
    frame, code, close_code = BAD_STARTS[case]
    client = StreamingVideoClient(realtime_server.ws_url)
    client.ws.send(frame)
    error = client.next_json()
    assert error["type"] == "error" and error["code"] == code and error["message"]
    assert "Traceback" not in error["message"]
    assert client.close_code() == close_code
    wait_idle(realtime_server)


BAD_CONTROLS = {
    "an unknown type": ('{"type": "session.pause"}', "unknown_type", 1008),
    "not JSON": ("{", "invalid_json", 1008),
    "no interaction object": ('{"type": "session.interaction", "prompt": "x"}', "invalid_message", 1008),
    "an empty event": ('{"type": "session.interaction", "interaction": {"event": {}}}', "invalid_message", 1008),
    "a negative transition": (json.dumps({"type": "session.interaction", "interaction": {
        "event": {"prompt": "x"}, "transition_chunks": -1}}), "invalid_message", 1008),
    "too large": (json.dumps({"type": "session.interaction", "interaction": {"event": {"prompt": "x" * 2**17}}}),
                  "message_too_large", 1009),
}


@pytest.mark.parametrize("case", list(BAD_CONTROLS))
def test_a_bad_message_mid_session_gets_an_error_and_a_clean_close(realtime_server, case):
    frame, code, close_code = BAD_CONTROLS[case]
    client = StreamingVideoClient(realtime_server.ws_url)
    start = client.start(**{**SESSION, "num_frames": 14_400})
    client.ws.send(frame)
    got = client.receive(start)
    assert got.errors()[-1]["code"] == code and got.done is None
    assert client.close_code() == close_code
    wait_idle(realtime_server)
    assert realtime_server.executor.streams[-1].closed


def test_a_late_start_gets_an_error_and_a_clean_close(realtime_server):
    client = StreamingVideoClient(realtime_server.ws_url)  # says nothing; the test server waits 1 s
    error = client.next_json(timeout=5)
    assert error["type"] == "error" and error["code"] == "start_timeout"
    assert client.close_code() == 1008
    wait_idle(realtime_server)


def test_a_client_that_leaves_mid_session_leaks_nothing(realtime_server):
    client = StreamingVideoClient(realtime_server.ws_url)
    client.receive(client.start(**{**SESSION, "num_frames": 14_400}), until_chunks=2)
    client.ws.close()
    wait_idle(realtime_server)
    stream = realtime_server.executor.streams[-1]
    assert stream.closed and len(stream.prompts) < 10  # aborted, not run to its ten minutes
    assert realtime_server.manager.replicas()[0].busy is False


def test_an_engine_failure_mid_session_is_an_error_and_a_clean_close(realtime_server):
    client = StreamingVideoClient(realtime_server.ws_url)
    got = client.receive(client.start(**{**SESSION, "prompt": FAIL_AT_PROMPT}))
    assert len(got.segments) == 2 and got.errors()[-1]["code"] == "internal_error"
    assert "fake engine" not in got.errors()[-1]["message"]  # an internal error's own text stays in the server log
    assert client.close_code() == 1011
    wait_idle(realtime_server)


def test_a_stalled_engine_ends_the_session(realtime_server):
    client = StreamingVideoClient(realtime_server.ws_url)
    got = client.receive(client.start(**{**SESSION, "prompt": STALL_PROMPT}))
    assert len(got.segments) == 2 and got.errors()[-1]["code"] == "stall_timeout"
    assert client.close_code() == 1011
    wait_idle(realtime_server)


def test_one_session_per_replica_else_429_with_retry_after(realtime_server):
    client = StreamingVideoClient(realtime_server.ws_url)
    client.start(**{**SESSION, "num_frames": 14_400})
    with pytest.raises(InvalidStatus) as refused:
        StreamingVideoClient(realtime_server.ws_url)
    response = refused.value.response
    assert response.status_code == 429 and int(response.headers["Retry-After"]) >= 1
    assert json.loads(response.body)["error"]["code"] == "busy"
    client.ws.close()
    wait_idle(realtime_server)
    StreamingVideoClient(realtime_server.ws_url).ws.close()  # the replica is free again


def test_a_wrong_api_key_is_refused_at_the_upgrade(realtime_server):
    for key in ("wrong", None):
        with pytest.raises(InvalidStatus) as refused:
            StreamingVideoClient(realtime_server.ws_url, key=key)
        assert refused.value.response.status_code == 401
    wait_idle(realtime_server)


def test_no_traceback_reached_the_server_log(realtime_server):
    assert not [line for line in realtime_server.errors if "Exception in ASGI application" in line]


def test_without_realtime_lora_the_route_says_so(tmp_path):
    with serve_realtime(tmp_path, FakeRealtimeExecutor(realtime=False), realtime=False) as server:
        client = StreamingVideoClient(server.ws_url)
        error = client.next_json()
        assert error["code"] == "realtime_unavailable" and "--realtime-lora" in error["message"]
        assert client.close_code() == 1008


def scrape(server) -> dict[tuple[str, tuple], float]:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_metrics_count_sessions_and_chunks(realtime_server):
    before = scrape(realtime_server)
    client = StreamingVideoClient(realtime_server.ws_url)
    got = client.receive(client.start(**SESSION), until_chunks=1)
    assert scrape(realtime_server)[("h3serve_realtime_sessions_open", ())] == 1
    client.receive(got.start)
    wait_idle(realtime_server)
    after = scrape(realtime_server)
    assert after[("h3serve_realtime_sessions_open", ())] == 0

    def grew(name: str, labels: tuple = ()) -> float:
        return after[(name, labels)] - before[(name, labels)]

    assert grew("h3serve_realtime_chunks_sent_total", (("kind", "media"),)) == 4
    assert grew("h3serve_realtime_chunks_sent_total", (("kind", "trailer"),)) == 1
    assert grew("h3serve_realtime_first_chunk_seconds_count") == 1
    assert grew("h3serve_realtime_chunk_seconds_count") == grew("h3serve_realtime_factor_count") == 3
    # the fake engine makes a chunk every 0.05 s; a chunk holds 17 or 34 frames (0.7 s or 1.4 s)
    assert 0 < grew("h3serve_realtime_factor_sum") / 3 < 1
