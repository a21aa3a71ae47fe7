"""FragmentWriter: every segment is fragmented MP4 that starts on a key frame and decodes on its own after the init
segment; the concatenation plays with exactly the frames and samples fed (checked with the system ffprobe/ffmpeg)."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
from fmp4_media import (
    chunk_samples,
    decode,
    ffmpeg_errors,
    ffprobe_streams,
    first_picture_is_key,
    split_init,
    synthetic_chunk,
    top_boxes,
)

from h3serve.media.fragments import FragmentWriter
from h3serve.media.mp4 import EncoderOptions

pytestmark = pytest.mark.skipif(
    shutil.which("ffprobe") is None or shutil.which("ffmpeg") is None, reason="needs ffmpeg/ffprobe"
)

H, W = 64, 128
PLAN = (39, 34, 34, 17)  # a session's first chunks (frames)


def run_session(plan=PLAN, options: EncoderOptions | None = None) -> tuple[list[bytes], np.ndarray, np.ndarray]:
    """Every segment (the trailer last), and the frames [T, H, W, 3] and audio [S, 2] fed."""
    writer = FragmentWriter(W, H, options=options)
    segments, frames, audio, at = [], [], [], 0
    for count in plan:
        video, sound = synthetic_chunk(at, count, H, W)
        segments.append(writer.segment(video, sound))
        frames.append(video)
        audio.append(sound)
        at += count
    segments.append(writer.finish())
    return segments, np.concatenate(frames), np.concatenate(audio)


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    segments, frames, audio = run_session()
    path = tmp_path_factory.mktemp("fmp4") / "session.mp4"
    path.write_bytes(b"".join(segments))
    return segments, frames, audio, path


def test_every_segment_is_a_fragment_that_starts_on_a_key_frame(session, tmp_path):
    segments, _, _, _ = session
    init, first = split_init(segments[0])
    for i, segment in enumerate([first, *segments[1:]]):
        assert [kind for kind, _ in top_boxes(segment)] == [b"moof", b"mdat"], i
        if i < len(PLAN):
            assert first_picture_is_key(segment), i
            # init + this segment alone is a valid MP4 that decodes this chunk's frames, cleanly
            alone = tmp_path / f"alone{i}.mp4"
            alone.write_bytes(init + segment)
            assert ffmpeg_errors(alone) == ""
            assert int(ffprobe_streams(alone)["video"]["nb_read_frames"]) == PLAN[i]


def test_concatenation_has_the_streams_and_exact_frame_count(session):
    _, frames, _, path = session
    streams = ffprobe_streams(path)
    v, a = streams["video"], streams["audio"]
    assert (v["codec_name"], v["pix_fmt"], v["r_frame_rate"]) == ("h264", "yuv420p", "24/1")
    assert (v["width"], v["height"]) == (W, H)
    assert int(v["nb_read_frames"]) == frames.shape[0] == sum(PLAN)
    assert v.get("color_space") == "bt709" and v.get("color_range") == "tv"
    assert (a["codec_name"], a["profile"], a["sample_rate"], a["channels"]) == ("aac", "LC", "32000", 2)
    assert ffmpeg_errors(path) == ""


def test_decoded_frames_equal_the_input_within_codec_loss(session):
    _, frames, _, path = session
    decoded, _ = decode(path)
    assert decoded.shape == frames.shape
    per_frame = np.abs(decoded.astype(np.float32) - frames).mean(axis=(1, 2, 3))
    assert per_frame.max() < 5.0, per_frame.max()  # the bound tests/media/test_mp4.py accepts
    # frame order: each decoded frame is closest to its own input frame
    assert np.abs(decoded[50].astype(np.float32) - frames[50]).mean() < np.abs(decoded[50] - frames[80]).mean()


def test_decoded_audio_is_the_samples_fed(session):
    _, _, audio, path = session
    _, pcm = decode(path)
    n = audio.shape[0]
    assert n == sum(chunk_samples(sum(PLAN[:i]), count) for i, count in enumerate(PLAN))
    # the priming is cut by the edit list; the decoder returns whole AAC frames, so at most one frame of zeros follows
    assert n <= pcm.shape[1] < n + 1024
    ref = audio.T
    err = pcm[:, 1024 : n - 1024] - ref[:, 1024 : n - 1024]  # aligned to the sample: the error is codec noise
    assert np.sqrt((err**2).mean()) < 0.02 * np.sqrt((ref**2).mean())
    assert np.abs(pcm[:, n + 100 :]).max(initial=0.0) < 0.05


def test_chunks_shorter_than_an_aac_frame_keep_every_sample(tmp_path):
    writer = FragmentWriter(W, H)
    segments, fed = [], 0
    for i in range(5):  # 1 frame and 300 samples a chunk: the encoder holds them until it has a whole frame
        video, _ = synthetic_chunk(i, 1, H, W)
        sound = np.full((300, 2), 0.25, dtype=np.float32)
        segments.append(writer.segment(video, sound))
        fed += 300
    segments.append(writer.finish())
    assert segments[-1] != b""
    path = tmp_path / "short.mp4"
    path.write_bytes(b"".join(segments))
    frames, pcm = decode(path)
    assert frames.shape[0] == 5
    assert fed <= pcm.shape[1] < fed + 1024
    assert abs(float(pcm[:, 200 : fed - 200].mean()) - 0.25) < 0.02


def test_identical_input_gives_identical_bytes():
    options = EncoderOptions(preset="ultrafast", threads=2)
    first, _, _ = run_session(PLAN[:2], options)
    again, _, _ = run_session(PLAN[:2], options)
    assert first == again


def test_mime_type_names_the_stream_in_the_init_segment(session):
    segments, _, _, _ = session
    init, _ = split_init(segments[0])
    writer = FragmentWriter(W, H)
    avcc = init[init.index(b"avcC") + 4 :]
    assert writer.codecs == f"avc1.{avcc[1]:02X}{avcc[2]:02X}{avcc[3]:02X}, mp4a.40.2"
    assert writer.mime_type == f'video/mp4; codecs="{writer.codecs}"'


def test_finish_ends_the_writer():
    writer = FragmentWriter(W, H)
    assert writer.finish() == b""  # nothing was sent, so no trailer (and no init segment) either
    assert writer.finish() == b""
    video, sound = synthetic_chunk(0, 2, H, W)
    with pytest.raises(ValueError, match="finished"):
        writer.segment(video, sound)


def _bad_chunks():
    video, sound = synthetic_chunk(0, 3, H, W)
    nan = sound.copy()
    nan[5, 1] = np.nan
    return {
        "frames float": (video.astype(np.float32), sound),
        "frames 3-D": (video[0], sound),
        "frames wrong size": (video[:, :, :64], sound),
        "frames RGBA": (np.concatenate([video, video[..., :1]], axis=-1), sound),
        "no frames": (video[:0], sound),
        "audio [2, S]": (video, np.ascontiguousarray(sound.T)),
        "audio float64": (video, sound.astype(np.float64)),
        "audio NaN": (video, nan),
        "audio list": (video, sound.tolist()),
    }


@pytest.mark.parametrize("case", list(_bad_chunks()))
def test_bad_chunks_raise_value_error(case):
    video, sound = _bad_chunks()[case]
    with pytest.raises(ValueError):
        FragmentWriter(W, H).segment(video, sound)


@pytest.mark.parametrize("kwargs", [{"width": 127, "height": 64}, {"width": 0, "height": 64},
                                    {"width": 128, "height": 64, "sample_rate": 32001},
                                    {"width": 128, "height": 64, "options": EncoderOptions(preset="warp")}])
def test_bad_settings_raise_value_error(kwargs):
    with pytest.raises(ValueError):
        FragmentWriter(**kwargs)

