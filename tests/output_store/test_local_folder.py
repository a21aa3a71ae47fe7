"""The data dir store (the default): the job folders are the published outputs; reads serve one byte range."""

from __future__ import annotations

import pytest

from h3serve.jobstore.job_files import JobFiles, UnsafePathError
from h3serve.output_store import open_output_store
from h3serve.output_store.interface import OutputMissing, RangeNotSatisfiable, single_range
from h3serve.output_store.local_folder import LocalFolderStore

JOB = "video_" + "cd" * 16


def test_the_job_folder_is_the_store(tmp_path):
    files = JobFiles(tmp_path / "jobs")
    store = open_output_store(None, files)
    assert isinstance(store, LocalFolderStore) and not store.remote
    data = bytes(range(200))
    files.job_dir(JOB).mkdir()
    files.file(JOB, "video.mp4").write_bytes(data)
    store.upload(JOB, "video.mp4", files.file(JOB, "video.mp4"), "video/mp4")  # already in place: kept
    assert store.head(JOB, "video.mp4").size == 200 and store.head(JOB, "thumbnail.webp") is None
    assert store.local_path(JOB, "video.mp4") == files.file(JOB, "video.mp4")
    assert store.read(JOB, "video.mp4").read_all() == data
    part = store.read(JOB, "video.mp4", "bytes=10-19")
    assert (part.content_range, part.read_all()) == ("bytes 10-19/200", data[10:20])
    assert store.list_names(JOB) == ["video.mp4"]
    assert store.presigned_url(JOB, "video.mp4", 60, "video/mp4", "a") is None  # served by the API server
    store.download(JOB, "video.mp4", tmp_path / "copy.mp4")
    assert (tmp_path / "copy.mp4").read_bytes() == data
    with pytest.raises(UnsafePathError):
        store.head(JOB, "../escape")
    store.remove(JOB)
    with pytest.raises(OutputMissing):
        store.read(JOB, "video.mp4")


def test_single_range():
    assert single_range(None, 100) is None
    assert single_range("bytes=0-9", 100) == (0, 9)
    assert single_range("bytes=90-", 100) == (90, 99)
    assert single_range("bytes=95-200", 100) == (95, 99)
    assert single_range("bytes=-5", 100) == (95, 99)
    assert single_range("bytes=-500", 100) == (0, 99)
    assert single_range("bytes=0-1,5-6", 100) is None  # several ranges: served whole
    assert single_range("items=0-1", 100) is None
    for outside in ("bytes=100-", "bytes=5-2", "bytes=-0"):
        with pytest.raises(RangeNotSatisfiable):
            single_range(outside, 100)
