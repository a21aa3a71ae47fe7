"""The real-time session's geometry (vLLM-Omni's TaoMate-H3): chunk frames and latents, audio boundaries on the
global timeline, published frames, and the clean K/V cache's retention and bound."""

from __future__ import annotations

from h3serve.rules import realtime_geometry as rt


def test_first_request_and_later_requests():
    first = rt.request_chunks(0)
    assert [c.frame_stop - c.frame_start for c in first] == [39, 34, 34, 17]
    assert [c.video_latents for c in first] == [12, 10, 10, 5]
    assert sum(c.audio_latents for c in first) == rt.REQUEST_AUDIO_LATENTS == 207
    for request in (1, 2, 3, 7, 12):
        chunks = rt.request_chunks(request)
        assert [c.frame_stop - c.frame_start for c in chunks] == [34, 34, 34, 17]
        assert [c.video_latents for c in chunks] == [10, 10, 10, 5]
        assert sum(c.audio_latents for c in chunks) in (198, 199)
        assert chunks[0].frame_start == 124 + 119 * (request - 1)
    # audio boundaries on the global 24 fps -> 40 Hz timeline, half to even
    assert [rt.audio_boundary(f) for f in (0, 39, 73, 107, 124, 243)] == [0, 65, 122, 178, 207, 405]
    assert rt.audio_boundary(3) == 5 and rt.audio_boundary(9) == 15
    assert [rt.video_time(i) * 3 for i in range(7)] == [0, 5, 25, 45, 65, 85, 90]


def test_published_frames_tile_the_session():
    for requests in (1, 2, 5):
        chunks = rt.CHUNKS_PER_REQUEST * requests
        spans = [rt.published_frames(i, chunks) for i in range(chunks)]
        assert [count for _, count in spans[:4]] == [34, 34, 34, 17 + (5 if requests == 1 else 0)]
        starts = [first for first, _ in spans]
        assert starts == [sum(count for _, count in spans[:i]) for i in range(chunks)]
        assert sum(count for _, count in spans) == rt.session_frames(chunks) == 124 + 119 * (requests - 1)
    assert rt.chunks_for_frames(1) == rt.chunks_for_frames(124) == 4
    assert rt.chunks_for_frames(125) == 8 and rt.chunks_for_frames(14_400) == 484


def test_retention_keeps_the_sink_and_two_recent_chunks():
    assert rt.kept_after_commit(2) == ((0, False), (1, False))
    assert rt.kept_after_commit(3) == ((0, True), (1, False), (2, False))
    assert rt.kept_after_commit(4) == ((0, True), (2, False), (3, False))
    chunks = (rt.CachedChunk(130, 48), rt.CachedChunk(114, 40), rt.CachedChunk(112, 40))
    assert rt.apply_keep(chunks, rt.kept_after_commit(3)) == (rt.CachedChunk(0, 48), *chunks[1:])
    assert rt.apply_keep(chunks, rt.kept_without_audio(3)) == tuple(rt.CachedChunk(0, c.video_rows) for c in chunks)
    assert [rt.audio_reset_at(r) for r in (0, 11, 12, 13, 24)] == [False, False, True, False, True]


def test_the_bound_is_the_most_rows_ever_held():
    for frame_rows in (4, 405):
        bound = rt.kv_rows_bound(frame_rows)
        # chunk 0 whole, chunk 1 whole and chunk 2 staged, before the sink ages: the early peak
        early = sum(rt.chunk_rows(rt.chunk(i), frame_rows).rows for i in range(3))
        assert bound >= early and bound == rt.kv_rows_bound(frame_rows, requests=40)
    assert rt.kv_cache_bytes(50, 56, 128, 2, 405) == 2 * 50 * rt.kv_rows_bound(405) * 56 * 128 * 2
