"""write_raw / read_raw: exact round trip, byte-reproducible .npz, atomic write, validation."""

from __future__ import annotations

import os
import time
import zipfile

import numpy as np
import pytest

from h3serve.media.raw import read_raw, write_raw


def make_arrays(frames: int = 17, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    video = rng.random((frames, 32, 48, 3), dtype=np.float32)
    audio = (rng.random((2, 1234), dtype=np.float32) * 2 - 1).astype(np.float32)
    return video, audio


def test_round_trip_is_exact(tmp_path):
    video, audio = make_arrays()
    write_raw(tmp_path / "r.npz", video, audio, fps=24, sample_rate=32000)
    v, a, fps, sr = read_raw(tmp_path / "r.npz")
    assert v.dtype == np.float32 and a.dtype == np.float32
    assert np.array_equal(v, video) and np.array_equal(a, audio)
    assert (fps, sr) == (24, 32000) and type(fps) is int and type(sr) is int


def test_np_load_reads_it(tmp_path):
    video, audio = make_arrays()
    write_raw(tmp_path / "r.npz", video, audio)
    with np.load(tmp_path / "r.npz") as data:
        assert sorted(data.files) == ["audio", "fps", "sample_rate", "video"]
        assert np.array_equal(data["video"], video) and np.array_equal(data["audio"], audio)
        assert int(data["fps"]) == 24 and int(data["sample_rate"]) == 32000


def test_byte_identical_regardless_of_clock(tmp_path, monkeypatch):
    video, audio = make_arrays()
    write_raw(tmp_path / "a.npz", video, audio)
    shift, real_time, real_localtime = 86_400 * 400, time.time, time.localtime  # "a year later"
    monkeypatch.setattr(time, "time", lambda: real_time() + shift)
    monkeypatch.setattr(time, "localtime", lambda secs=None: real_localtime((secs or real_time()) + shift))
    write_raw(tmp_path / "b.npz", video.copy(), audio.copy())
    assert (tmp_path / "a.npz").read_bytes() == (tmp_path / "b.npz").read_bytes()
    with zipfile.ZipFile(tmp_path / "a.npz") as zf:
        assert {info.date_time for info in zf.infolist()} == {(1980, 1, 1, 0, 0, 0)}


def test_different_content_gives_different_bytes(tmp_path):
    video, audio = make_arrays()
    write_raw(tmp_path / "a.npz", video, audio)
    write_raw(tmp_path / "b.npz", video, audio, fps=25)
    other = video.copy()
    other[3, 4, 5, 1] += 0.5
    write_raw(tmp_path / "c.npz", other, audio)
    blobs = {(tmp_path / n).read_bytes() for n in ("a.npz", "b.npz", "c.npz")}
    assert len(blobs) == 3


def test_overwrite_leaves_no_temp_files(tmp_path):
    video, audio = make_arrays()
    (tmp_path / "r.npz").write_bytes(b"old")
    write_raw(tmp_path / "r.npz", video, audio)
    assert os.listdir(tmp_path) == ["r.npz"]
    assert np.array_equal(read_raw(tmp_path / "r.npz")[0], video)


def test_odd_sizes_are_fine_for_raw(tmp_path):
    video, audio = make_arrays()
    write_raw(tmp_path / "r.npz", video[:, :31, :45], audio[:, :7])
    assert read_raw(tmp_path / "r.npz")[0].shape == (17, 31, 45, 3)


@pytest.mark.parametrize(
    "mutate",
    [
        lambda v, a: (v.astype(np.float64), a),
        lambda v, a: (v[..., :2], a),
        lambda v, a: (v[0], a),
        lambda v, a: (v, a[:1]),
        lambda v, a: (v, a.T.copy()),
        lambda v, a: (v, a.astype(np.float16)),
    ],
    ids=["video float64", "video 2 channels", "video 3-D", "audio mono", "audio [N,2]", "audio float16"],
)
def test_bad_inputs_raise_value_error(tmp_path, mutate):
    video, audio = mutate(*make_arrays())
    with pytest.raises(ValueError):
        write_raw(tmp_path / "r.npz", video, audio)
    assert os.listdir(tmp_path) == []


def test_read_errors(tmp_path):
    with pytest.raises(FileNotFoundError):
        read_raw(tmp_path / "missing.npz")
    (tmp_path / "junk.npz").write_bytes(b"PK\x03\x04 definitely not a zip")
    with pytest.raises(ValueError):
        read_raw(tmp_path / "junk.npz")
    np.savez(tmp_path / "other.npz", x=np.zeros(3))
    with pytest.raises(ValueError, match="missing entries"):
        read_raw(tmp_path / "other.npz")
    video, audio = make_arrays()
    write_raw(tmp_path / "cut.npz", video, audio)
    data = (tmp_path / "cut.npz").read_bytes()
    (tmp_path / "cut.npz").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError):
        read_raw(tmp_path / "cut.npz")
