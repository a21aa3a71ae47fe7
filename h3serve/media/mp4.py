"""MP4 writer: H.264 (libx264, yuv420p, BT.709) video + AAC-LC stereo audio, encoded in-process with PyAV."""

from __future__ import annotations

import sys
from dataclasses import dataclass, replace
from fractions import Fraction

import av
import numpy as np
from av.video.reformatter import ColorPrimaries, ColorRange, Colorspace, ColorTrc, Interpolation

from h3serve.media.aac_packets import AAC_FRAME_SAMPLES, AacPackets, aac_input
from h3serve.media.raw import PathLike, atomic_output, validate_media
from h3serve.rules import limits
from h3serve.rules.names import DEFAULT_CRF, DEFAULT_X264_PRESET, VIDEO_ENCODERS, X264_PRESETS

AAC_SAMPLE_RATES = (7350, 8000, 11025, 12000, 16000, 22050, 24000, 32000, 44100, 48000, 64000, 88200, 96000)

# RGB -> yuv420p with swscale's bit-exact C path (no CPU-specific SIMD rounding); BILINEAR sets chroma filtering.
_SWS_FLAGS = Interpolation.BILINEAR | Interpolation.ACCURATE_RND | Interpolation.BITEXACT
# The libx264 in the PyAV 18.1 wheel is not run-to-run deterministic with mb-tree on (its AVX2 kernels): identical
# input gave a different bitstream in 8 of 25 encodes of a 1344x768 clip when unrelated allocations had run in the
# process before (heap-state dependent; x264 asm without AVX2, or mbtree=0, gave 0 of 25+). mbtree=0 is portable;
# at CRF 18 it costs ~17% more bytes for ~1.8 dB more PSNR on a textured test clip.
_X264_PARAMS = "mbtree=0"


@dataclass(frozen=True)
class EncoderOptions:
    """Encoder settings. ``threads=0`` lets x264 pick (about 1.5x the CPU count).

    Output bytes depend on the x264 thread count, so they are reproducible for a fixed ``threads`` on any
    machine, but with ``threads=0`` only between machines with the same number of CPUs. `encoder` auto or nvenc
    takes NVENC only where frames stay on a GPU that has one (h3serve.media.nvenc); elsewhere x264 writes.
    """

    preset: str = DEFAULT_X264_PRESET  # x264 preset
    crf: int = DEFAULT_CRF  # x264 CRF (NVENC: its constant QP)
    audio_bitrate: int = 192_000
    threads: int = 0  # 0 = auto
    encoder: str = "auto"  # auto | x264 | nvenc (--video-encoder)

    def for_request(self, preset: str | None, crf: int | None) -> EncoderOptions:
        """These settings with a request's own preset and CRF (extra_params.video_codec_options) where it gives
        them."""
        return replace(self, preset=preset or self.preset, crf=self.crf if crf is None else crf)

    def validate(self, sample_rate: int = limits.AUDIO_SAMPLE_RATE) -> EncoderOptions:
        """`self` if every option is legal for audio at `sample_rate`; else `ValueError` naming the option."""
        _validate_options(self, sample_rate)
        return self


def _validate_options(options: EncoderOptions, sample_rate: int) -> None:
    if options.preset not in X264_PRESETS:
        raise ValueError(f"unknown x264 preset {options.preset!r}; expected one of {', '.join(X264_PRESETS)}")
    if not 0 <= options.crf <= 51:
        raise ValueError(f"crf must be in [0, 51], got {options.crf}")
    if not 8_000 <= options.audio_bitrate <= 512_000:
        raise ValueError(f"audio_bitrate must be in [8000, 512000] bit/s, got {options.audio_bitrate}")
    if options.encoder not in VIDEO_ENCODERS:
        raise ValueError(f"unknown video encoder {options.encoder!r}; expected one of {', '.join(VIDEO_ENCODERS)}")
    if options.threads < 0:
        raise ValueError(f"threads must be >= 0 (0 = auto), got {options.threads}")
    if sample_rate not in AAC_SAMPLE_RATES:
        raise ValueError(f"AAC does not support sample_rate={sample_rate}; use one of {AAC_SAMPLE_RATES}")


VIDEO_ENCODER_HELP = (
    "auto (default): NVENC where the decoded frames stay on a GPU that has one and PyNvVideoCodec is installed (the "
    "nvenc extra), else x264 | x264 | nvenc (on such a GPU, with --decode-mode stream). The log says which ran"
)


def nvenc_refusal(options: EncoderOptions, decode_mode: str) -> None:
    """`ValueError` when NVENC is asked for where it cannot get the frames: a full decode hands host arrays over."""
    if options.encoder == "nvenc" and decode_mode != "stream":
        raise ValueError("--video-encoder nvenc needs --decode-mode stream (NVENC takes the frames on the GPU as "
                         "they are decoded; a full decode's MP4 is written from host arrays, by x264)")


def audio_samples_for(frames: int, fps: int, sample_rate: int) -> int:
    """Number of audio samples covering ``frames / fps`` seconds, rounded to the nearest sample."""
    return (2 * frames * sample_rate + fps) // (2 * fps)


def fit_audio(audio: np.ndarray, n: int) -> np.ndarray:
    """Trim or zero-pad [C, N] ``audio`` to exactly ``n`` samples, clipped to [-1, 1], as float32."""
    out = np.zeros((audio.shape[0], n), dtype=np.float32)
    m = min(n, audio.shape[1])
    np.clip(audio[:, :m], -1.0, 1.0, out=out[:, :m])
    return out


def rgb8(video: np.ndarray) -> np.ndarray:
    """float32 frames in [0, 1] -> uint8 RGB, exactly as the MP4 stores them (round half to even, clipped)."""
    return np.clip(np.rint(video * 255.0), 0, 255).astype(np.uint8)


def yuv_frame(rgb: np.ndarray, index: int) -> av.VideoFrame:
    """uint8 [H,W,3] RGB -> BT.709 limited-range yuv420p VideoFrame with pts ``index``."""
    yuv = av.VideoFrame.from_ndarray(np.ascontiguousarray(rgb), format="rgb24").reformat(
        format="yuv420p",
        dst_colorspace=Colorspace.ITU709,
        dst_color_range=ColorRange.MPEG,
        dst_color_trc=ColorTrc.BT709,
        dst_color_primaries=ColorPrimaries.BT709,
        interpolation=_SWS_FLAGS,
        threads=1,
    )
    yuv.pts = index
    return yuv


class Mp4Writer:
    """An MP4 written frame chunk by frame chunk: the soundtrack is given whole up front, the video frames
    (uint8 RGB) as they come; audio is interleaved after each frame. Used as a context manager: the file
    appears at ``path`` (atomically) only when every announced frame was written and the block exits cleanly.

    `write_mp4` is this writer fed the whole video, so a streamed and a whole encode of the same uint8 frames
    give the same bytes."""

    def __init__(
        self,
        path: PathLike,
        num_frames: int,
        height: int,
        width: int,
        audio: np.ndarray,
        fps: int = 24,
        sample_rate: int = 32000,
        options: EncoderOptions = EncoderOptions(),  # noqa: B008 (frozen, so a shared default is safe)
        audio_follows: bool = False,
    ):
        """`audio_follows`: the soundtrack comes with the frames (`append_audio`, a real-time session's chunks)
        instead of whole in `audio`; an AAC frame is encoded once all its samples are there."""
        probe = np.zeros((1, height, width, 3), dtype=np.float32)
        validate_media(probe, audio, fps, sample_rate, even_dims=True)
        _validate_options(options, sample_rate)
        if num_frames < 1:
            raise ValueError(f"an MP4 needs at least one frame, got {num_frames}")
        if not np.isfinite(audio).all():
            raise ValueError("audio contains NaN or inf")
        self.path, self.options = path, options
        self.num_frames, self.height, self.width = num_frames, height, width
        self.fps, self.sample_rate = int(fps), int(sample_rate)
        self.n_samples = audio_samples_for(num_frames, self.fps, self.sample_rate)
        self.pcm = fit_audio(audio, self.n_samples)
        self.written = 0
        self._audio_done = 0
        self._audio_given = 0 if audio_follows else self.n_samples  # samples of `pcm` that hold the soundtrack
        self._output = None
        self._container = None
        self._aac: AacPackets | None = None  # a whole soundtrack's packets, encoded beside the video

    def __enter__(self) -> Mp4Writer:
        self._output = atomic_output(self.path)
        tmp = self._output.__enter__()
        try:
            self._open(tmp)
        except BaseException:
            self._output.__exit__(*sys.exc_info())
            raise
        return self

    def _open(self, tmp) -> None:
        options = self.options
        self._container = container = av.open(str(tmp), "w", format="mp4", options={"movflags": "+faststart"})
        self._vstream = self._open_video(container)
        self._astream = astream = container.add_stream("aac", rate=self.sample_rate, layout="stereo")
        astream.bit_rate = options.audio_bitrate
        if self._audio_given == self.n_samples:  # given whole: encoded on its own thread from now on
            self._aac = AacPackets(astream, self.pcm, self.sample_rate)

    def _open_video(self, container) -> av.VideoStream:
        """The H.264 stream and its encoder: libx264 here (h3serve.media.nvenc's writer: NVENC)."""
        options = self.options
        vstream = container.add_stream("libx264", rate=self.fps)
        vstream.width, vstream.height, vstream.pix_fmt = self.width, self.height, "yuv420p"
        vstream.time_base = Fraction(1, self.fps)
        vcc = vstream.codec_context
        vcc.options = {"preset": options.preset, "crf": str(options.crf), "x264-params": _X264_PARAMS}
        vcc.thread_count, vcc.thread_type = options.threads, "FRAME"
        vcc.colorspace, vcc.color_range = Colorspace.ITU709, ColorRange.MPEG
        vcc.color_primaries, vcc.color_trc = ColorPrimaries.BT709, ColorTrc.BT709
        return vstream

    def _encode_video(self, frame, index: int) -> list[av.Packet]:
        """One frame's packets (x264 buffers frames for its lookahead: often none yet); None: flush the encoder."""
        return self._vstream.encode(None if frame is None else yuv_frame(frame, index))

    def _check_frames(self, frames) -> None:
        if frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[1:] != (self.height, self.width, 3):
            raise ValueError(
                f"frames must be uint8 [t, {self.height}, {self.width}, 3], got {frames.dtype} {list(frames.shape)}"
            )

    def _encode_audio_until(self, end: int) -> None:
        """Encode the 1024-sample frames starting before ``end``."""
        done, container = self._audio_done, self._container
        if self._aac is not None:
            while done < min(end, self.n_samples):
                container.mux(self._aac.frame(done // AAC_FRAME_SAMPLES))
                done += min(AAC_FRAME_SAMPLES, self.n_samples - done)
            self._audio_done = done
            return
        while done < min(end, self.n_samples):
            if self._audio_given < self.n_samples and done + AAC_FRAME_SAMPLES > self._audio_given:
                break  # the rest of this AAC frame's samples come with the next frames
            container.mux(self._astream.encode(aac_input(self.pcm, done, self.sample_rate)))
            done += min(AAC_FRAME_SAMPLES, self.n_samples - done)
        self._audio_done = done

    def append_audio(self, samples: np.ndarray) -> None:
        """The next stretch of a following soundtrack, float32 [2, n] (past the announced length: dropped)."""
        if not np.isfinite(samples).all():
            raise ValueError("audio contains NaN or inf")
        start = self._audio_given
        stop = min(self.n_samples, start + samples.shape[1])
        np.clip(samples[:, : stop - start], -1.0, 1.0, out=self.pcm[:, start:stop])
        self._audio_given = stop

    def write(self, frames: np.ndarray) -> None:
        """Encode uint8 frames [t, H, W, 3] (RGB) after those already written."""
        self._check_frames(frames)
        if self.written + frames.shape[0] > self.num_frames:
            raise ValueError(f"more than the announced {self.num_frames} frames")
        for rgb in frames:
            i = self.written
            self._container.mux(self._encode_video(rgb, i))
            # Interleave: after each video frame, encode the audio up to that frame's end time.
            self._encode_audio_until((i + 1) * self.sample_rate // self.fps + 1)
            self.written += 1

    def __exit__(self, kind, value, tb) -> None:
        try:
            if kind is None:
                if self.written != self.num_frames:
                    raise ValueError(f"{self.written} of the announced {self.num_frames} frames were written")
                self._container.mux(self._encode_video(None, self.written))
                self._audio_given = self.n_samples  # a following soundtrack's missing end is silence
                self._encode_audio_until(self.n_samples)
                self._container.mux(self._aac.flush() if self._aac is not None else self._astream.encode(None))
        except BaseException:
            self._close_aac()
            self._container.close()
            self._output.__exit__(*sys.exc_info())
            raise
        self._close_aac()
        self._container.close()
        self._output.__exit__(kind, value, tb)

    def _close_aac(self) -> None:
        if self._aac is not None:
            self._aac.close()


def write_mp4(
    path: PathLike,
    video: np.ndarray,
    audio: np.ndarray,
    fps: int = 24,
    sample_rate: int = 32000,
    options: EncoderOptions = EncoderOptions(),  # noqa: B008 (frozen, so a shared default is safe)
) -> None:
    """Encode ``video`` float32 [T,H,W,3] in [0,1] and ``audio`` float32 [2,N] in [-1,1] into an MP4.

    The video is H.264 yuv420p at ``fps`` with exactly T frames; the audio is AAC-LC stereo, trimmed or
    zero-padded to T/fps seconds. H and W must be even. Identical inputs and options give identical bytes.
    The file is written next to ``path`` under a temporary name, fsynced and renamed into place.
    """
    validate_media(video, audio, fps, sample_rate, even_dims=True)
    n_frames, height, width, _ = video.shape
    with Mp4Writer(path, n_frames, height, width, audio, fps, sample_rate, options) as writer:
        for i in range(n_frames):
            if not np.isfinite(video[i]).all():
                raise ValueError(f"video frame {i} contains NaN or inf")
            writer.write(rgb8(video[i : i + 1]))
