"""The geometry of a real-time session (TaoMate-H3's causal streaming), as integers: torch-free, shared by the
rank that generates it, the planner that sizes its K/V cache and the parent that reports its chunks.

A session is a run of five-second *requests*, each generated as four causal *chunks* (phases) of 2, 2, 2 and 1
native 17-frame groups. The first request also owns the standalone request's 5-frame (2-latent) prefix: 39/34/34/17
frames, 12/10/10/5 video latents, 37 in all (the released 124-frame request); later requests add 34/34/34/17 frames
(35 latents). Audio latents run at 40 Hz and every chunk's audio boundary is rounded (half to even) on the global
24 fps timeline. The video VAE decodes a chunk's latents in windows of 7 with a 5-frame overlap, so the frames a chunk
*publishes* lag its latents: 34/34/34/17 per request, and the session's last 5 frames come with its last chunk.

The clean K/V cache keeps chunk 0's video as a sink plus the two most recent chunks (audio and video), and drops
every audio row at the start of every 12th request (`kept_after_commit`, `kept_without_audio`); `kv_rows_bound` is
the most rows it ever holds with one chunk staged. All of it follows vLLM-Omni's
`vllm_omni/diffusion/models/taomate_h3/`.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

from h3serve.rules import limits

PREFIX_FRAMES, PREFIX_LATENTS = 5, 2  # the first request's affine prefix
PHASE_GROUPS = (2, 2, 2, 1)  # 17-frame groups per chunk
CHUNKS_PER_REQUEST = len(PHASE_GROUPS)
REQUEST_FRAMES = 124  # the first request (the released standalone request)
STEADY_FRAMES = REQUEST_FRAMES - PREFIX_FRAMES  # 119: every later request
REQUEST_VIDEO_LATENTS, REQUEST_AUDIO_LATENTS = 37, 207  # a standalone request's noise draw
STEADY_LATENTS = REQUEST_VIDEO_LATENTS - PREFIX_LATENTS  # 35: every later request
STUDENT_STEPS = 3  # denoise steps per chunk
LADDER_POINTS, LADDER_INDICES = 50, (0, 16, 33, 49)  # the student's steps on the 50-point shifted ladders
TEACHER_POINTS, TEACHER_STATES = 10, (3, 6, 9)  # the base model's audio: 9 forwards; these states feed the student
ROLLOVER_LATENTS = 40  # the previous request's clean audio tail the audio teacher continues from (per channel)
AUDIO_RESET_REQUESTS = 12  # the cached audio rows are dropped at the start of every 12th request
RECENT_CHUNKS = 2  # complete chunks the cache keeps besides the sink
CHUNKS_AHEAD = 2  # chunks the ranks may generate beyond what the session's reader has taken (spool, prompt latency)
VIDEO_SEED_STRIDE = 1_000_003  # request k's video noise: seed + k·stride (its audio noise: seed + k)
WINDOW_LATENTS, WINDOW_STEP, WINDOW_FRAMES, OVERLAP_FRAMES = 7, 5, 17, 5  # the video VAE's temporal windows
_TIME_SPANS = (1, 4, 4, 4, 4)  # pixel frames per latent (mod 5), each 5/3 RoPE units
_TIME_SCALE = Fraction(5, 3)


def audio_boundary(frame: int) -> int:
    """The 40 Hz audio latent at a 24 fps frame boundary, rounded half to even (exact rational arithmetic)."""
    return round(Fraction(frame * limits.AUDIO_LATENTS_PER_SECOND, limits.FPS))


def video_time(latent: int) -> Fraction:
    """RoPE time of global video latent `latent` from the media origin: the 5/3·(1, 4, 4, 4, 4) steps summed."""
    whole, part = divmod(latent, len(_TIME_SPANS))
    return _TIME_SCALE * (whole * sum(_TIME_SPANS) + sum(_TIME_SPANS[:part]))


def samples_at(frame: int) -> int:
    """Audio samples (32 kHz) before 24 fps frame `frame`."""
    return frame * limits.AUDIO_SAMPLE_RATE // limits.FPS


@dataclass(frozen=True)
class Chunk:
    """One chunk of a session: its request and phase, and its frames and latents on the global timeline."""

    index: int  # the session's chunk index (generation_chunk_index)
    request: int
    phase: int
    frame_start: int
    frame_stop: int
    video_start: int  # global video latents [start, stop)
    video_stop: int
    audio_start: int  # global audio latents per channel [start, stop)
    audio_stop: int
    request_video_start: int  # where the chunk's request starts (its text is aligned to it)
    request_audio_start: int

    @property
    def video_latents(self) -> int:
        return self.video_stop - self.video_start

    @property
    def audio_latents(self) -> int:
        return self.audio_stop - self.audio_start

    @property
    def first_in_request(self) -> bool:
        return self.phase == 0

    @property
    def last_in_request(self) -> bool:
        return self.phase == CHUNKS_PER_REQUEST - 1


def request_start(request: int) -> tuple[int, int, int]:
    """(frame, video latent, audio latent) where request `request` starts on the global timeline."""
    if request == 0:
        return 0, 0, 0
    frame = REQUEST_FRAMES + (request - 1) * STEADY_FRAMES
    return frame, REQUEST_VIDEO_LATENTS + (request - 1) * STEADY_LATENTS, audio_boundary(frame)


def chunk(index: int) -> Chunk:
    """Chunk `index` of a session (the first request's first chunk carries the 5-frame prefix)."""
    request, phase = divmod(index, CHUNKS_PER_REQUEST)
    frame0, video0, audio0 = request_start(request)
    frame, video = frame0, video0
    for p in range(phase + 1):
        start_frame, start_video = frame, video
        groups = PHASE_GROUPS[p]
        frame += groups * limits.VAE_FRAMES_PER_CHUNK + (PREFIX_FRAMES if request == 0 and p == 0 else 0)
        video += groups * limits.VAE_LATENTS_PER_CHUNK + (PREFIX_LATENTS if request == 0 and p == 0 else 0)
    return Chunk(index, request, phase, start_frame, frame, start_video, video, audio_boundary(start_frame),
                 audio_boundary(frame), video0, audio0)


def request_chunks(request: int) -> tuple[Chunk, ...]:
    return tuple(chunk(request * CHUNKS_PER_REQUEST + p) for p in range(CHUNKS_PER_REQUEST))


def chunks_for_frames(num_frames: int) -> int:
    """Chunks of a session asked for `num_frames` frames: whole requests until they publish at least that many."""
    if num_frames < 1:
        raise ValueError(f"num_frames must be >= 1, got {num_frames}")
    requests = 1 + max(0, -(-(num_frames - REQUEST_FRAMES) // STEADY_FRAMES))
    return requests * CHUNKS_PER_REQUEST


def session_frames(chunks: int) -> int:
    """Frames a session of `chunks` chunks (whole requests) publishes in all."""
    return chunk(chunks - 1).frame_stop


def _windows(latents: int) -> int:
    """Video VAE windows complete over `latents` latents."""
    return 0 if latents < WINDOW_LATENTS else (latents - WINDOW_LATENTS) // WINDOW_STEP + 1


def published_frames(index: int, chunks: int) -> tuple[int, int]:
    """(first frame, frame count) chunk `index` of a `chunks`-chunk session publishes: its complete VAE windows, and
    at the last chunk the final 5-frame overlap too."""
    c = chunk(index)
    before = _windows(c.video_start) * WINDOW_FRAMES
    count = _windows(c.video_stop) * WINDOW_FRAMES - before
    return before, count + (OVERLAP_FRAMES if index == chunks - 1 else 0)


# -- the clean K/V cache's retention ------------------------------------------------------------------------------


@dataclass(frozen=True)
class CachedChunk:
    """A committed chunk's rows in the cache, in packed order: its audio rows (both channels), then its video rows."""

    audio_rows: int
    video_rows: int

    @property
    def rows(self) -> int:
        return self.audio_rows + self.video_rows


def chunk_rows(c: Chunk, frame_rows: int) -> CachedChunk:
    """The rows chunk `c` commits: 2 audio rows per latent, `frame_rows` video rows per latent."""
    return CachedChunk(limits.AUDIO_CHANNELS * c.audio_latents, c.video_latents * frame_rows)


Keep = tuple[tuple[int, bool], ...]  # which cached chunks survive: (index, video rows only)


def kept_after_commit(count: int) -> Keep:
    """Which of `count` cached chunks survive a commit: once there are three, the first becomes video-only (the sink)
    and only the two most recent stay besides it."""
    if count <= RECENT_CHUNKS:
        return tuple((i, False) for i in range(count))
    return ((0, True), *((i, False) for i in range(max(1, count - RECENT_CHUNKS), count)))


def kept_without_audio(count: int) -> Keep:
    """The periodic audio reset: every chunk keeps its video rows only."""
    return tuple((i, True) for i in range(count))


def apply_keep(chunks: tuple[CachedChunk, ...], keep: Keep) -> tuple[CachedChunk, ...]:
    """The cached chunks after `keep` (a chunk left without rows is gone)."""
    out = (CachedChunk(0 if video_only else chunks[i].audio_rows, chunks[i].video_rows) for i, video_only in keep)
    return tuple(c for c in out if c.rows)


def audio_reset_at(request: int) -> bool:
    """Whether the cached audio rows are dropped before request `request` starts."""
    return request > 0 and request % AUDIO_RESET_REQUESTS == 0


def kv_rows_bound(frame_rows: int, requests: int = 2 * AUDIO_RESET_REQUESTS + 1) -> int:
    """The most rows the cache holds at once (history plus the chunk being staged) over a session of `requests`
    requests (the default covers two audio resets; the pattern repeats after them)."""
    history: tuple[CachedChunk, ...] = ()
    most = 0
    for index in range(requests * CHUNKS_PER_REQUEST):
        c = chunk(index)
        if c.first_in_request and audio_reset_at(c.request):
            history = apply_keep(history, kept_without_audio(len(history)))
        staged = chunk_rows(c, frame_rows)
        most = max(most, sum(h.rows for h in history) + staged.rows)
        history = apply_keep((*history, staged), kept_after_commit(len(history) + 1))
    return most


def kv_cache_bytes(layers: int, heads: int, head_dim: int, element_size: int, frame_rows: int) -> int:
    """Bytes of the cache's K and V buffers on one rank (`heads`: its head shard) for a canvas of `frame_rows` video
    rows per latent."""
    return 2 * layers * kv_rows_bound(frame_rows) * heads * head_dim * element_size
