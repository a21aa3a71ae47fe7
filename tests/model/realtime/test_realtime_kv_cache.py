"""The clean K/V cache holds what the retention rules say, row for row, in buffers of the planned size."""

from __future__ import annotations

import pytest
import torch

from h3serve.model.realtime.kv_cache import CleanKVCache
from h3serve.rules import realtime_geometry as rt


def _chunk_tensor(index: int, c: rt.CachedChunk) -> torch.Tensor:
    """A chunk's rows marked with its index (audio rows negative) in every head and channel: [1, rows, 2, 3]."""
    marks = torch.cat([-torch.full((c.audio_rows,), index + 1.0), torch.full((c.video_rows,), index + 1.0)])
    return marks.view(1, -1, 1, 1).expand(1, -1, 2, 3).clone()


def test_the_cache_keeps_the_sink_and_the_recent_chunks_across_audio_resets():
    frame_rows, layers = 4, 3
    bound = rt.kv_rows_bound(frame_rows)
    cache = CleanKVCache(layers, 2, 3, bound, torch.float32, torch.device("cpu"))
    assert cache.nbytes == rt.kv_cache_bytes(layers, 2, 3, 4, frame_rows)
    expected: list[tuple[int, rt.CachedChunk]] = []  # (chunk index, what of it is kept)
    for index in range(26 * rt.CHUNKS_PER_REQUEST):  # two audio resets
        c = rt.chunk(index)
        if c.first_in_request and rt.audio_reset_at(c.request):
            cache.drop_audio()
            expected = [(i, rt.CachedChunk(0, k.video_rows)) for i, k in expected]
        rows = rt.chunk_rows(c, frame_rows)
        tensor = _chunk_tensor(index, rows)
        for layer in range(layers):
            cache.stage(layer, tensor * (layer + 1), -tensor * (layer + 1))
        cache.commit(rows)
        expected.append((index, rows))
        keep = rt.kept_after_commit(len(expected))
        expected = [(expected[i][0], rt.CachedChunk(0 if video else expected[i][1].audio_rows,
                                                    expected[i][1].video_rows)) for i, video in keep]
        want = torch.cat([_chunk_tensor(i, k) for i, k in expected], dim=1)
        assert cache.rows == want.shape[1] <= bound
        for layer in range(layers):
            keys, values = cache.history(layer)
            assert torch.equal(keys, want * (layer + 1)) and torch.equal(values, -want * (layer + 1))
    assert expected[0][0] == 0 and [i for i, _ in expected[1:]] == [index - 1, index]  # the sink, two recent


def test_a_partial_stage_is_refused_and_rolled_back():
    cache = CleanKVCache(2, 1, 1, 10, torch.float32, torch.device("cpu"))
    cache.stage(0, torch.ones(1, 3, 1, 1), torch.ones(1, 3, 1, 1))
    with pytest.raises(RuntimeError, match=r"staged \[3, None\]"):
        cache.commit(rt.CachedChunk(1, 2))
    with pytest.raises(RuntimeError, match="twice"):
        cache.stage(0, torch.ones(1, 3, 1, 1), torch.ones(1, 3, 1, 1))
    cache.rollback()
    assert cache.rows == 0 and cache.staged == [None, None]
