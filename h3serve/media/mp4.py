"""MP4 writer: H.264 (libx264, yuv420p, BT.709) video + AAC-LC stereo audio, encoded in-process with PyAV."""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

import av
import numpy as np
from av.video.reformatter import ColorPrimaries, ColorRange, Colorspace, ColorTrc, Interpolation

from h3serve import limits
from h3serve.media.raw import PathLike, atomic_output, validate_media

AAC_FRAME_SAMPLES = 1024
AAC_SAMPLE_RATES = (7350, 8000, 11025, 12000, 16000, 22050, 24000, 32000, 44100, 48000, 64000, 88200, 96000)
X264_PRESETS = (
    "ultrafast", "superfast", "veryfast", "faster", "fast", "medium", "slow", "slower", "veryslow", "placebo",
)  # fmt: skip

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
    machine, but with ``threads=0`` only between machines with the same number of CPUs.
    """

    preset: str = "medium"  # x264 preset
    crf: int = 18  # x264 CRF
    audio_bitrate: int = 192_000
    threads: int = 0  # 0 = auto

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
    if options.threads < 0:
        raise ValueError(f"threads must be >= 0 (0 = auto), got {options.threads}")
    if sample_rate not in AAC_SAMPLE_RATES:
        raise ValueError(f"AAC does not support sample_rate={sample_rate}; use one of {AAC_SAMPLE_RATES}")


def audio_samples_for(frames: int, fps: int, sample_rate: int) -> int:
    """Number of audio samples covering ``frames / fps`` seconds, rounded to the nearest sample."""
    return (2 * frames * sample_rate + fps) // (2 * fps)


def fit_audio(audio: np.ndarray, n: int) -> np.ndarray:
    """Trim or zero-pad [C, N] ``audio`` to exactly ``n`` samples, clipped to [-1, 1], as float32."""
    out = np.zeros((audio.shape[0], n), dtype=np.float32)
    m = min(n, audio.shape[1])
    np.clip(audio[:, :m], -1.0, 1.0, out=out[:, :m])
    return out


def _rgb_frame(frame: np.ndarray, index: int) -> av.VideoFrame:
    """float32 [H,W,3] in [0,1] -> BT.709 limited-range yuv420p VideoFrame with pts ``index``."""
    if not np.isfinite(frame).all():
        raise ValueError(f"video frame {index} contains NaN or inf")
    rgb = np.clip(np.rint(frame * 255.0), 0, 255).astype(np.uint8)
    yuv = av.VideoFrame.from_ndarray(rgb, format="rgb24").reformat(
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
    _validate_options(options, sample_rate)
    if not np.isfinite(audio).all():
        raise ValueError("audio contains NaN or inf")
    fps, sample_rate = int(fps), int(sample_rate)
    n_frames, height, width, _ = video.shape
    n_samples = audio_samples_for(n_frames, fps, sample_rate)
    pcm = fit_audio(audio, n_samples)

    with atomic_output(path) as tmp:
        with av.open(str(tmp), "w", format="mp4", options={"movflags": "+faststart"}) as container:
            vstream = container.add_stream("libx264", rate=fps)
            vstream.width, vstream.height, vstream.pix_fmt = width, height, "yuv420p"
            vstream.time_base = Fraction(1, fps)
            vcc = vstream.codec_context
            vcc.options = {"preset": options.preset, "crf": str(options.crf), "x264-params": _X264_PARAMS}
            vcc.thread_count, vcc.thread_type = options.threads, "FRAME"
            vcc.colorspace, vcc.color_range = Colorspace.ITU709, ColorRange.MPEG
            vcc.color_primaries, vcc.color_trc = ColorPrimaries.BT709, ColorTrc.BT709

            astream = container.add_stream("aac", rate=sample_rate, layout="stereo")
            astream.bit_rate = options.audio_bitrate
            audio_tb = Fraction(1, sample_rate)

            def encode_audio_until(done: int, end: int) -> int:
                """Encode the 1024-sample frames starting before ``end``; return the new start offset."""
                while done < min(end, n_samples):
                    chunk = np.ascontiguousarray(pcm[:, done : done + AAC_FRAME_SAMPLES])
                    frame = av.AudioFrame.from_ndarray(chunk, format="fltp", layout="stereo")
                    frame.sample_rate, frame.pts, frame.time_base = sample_rate, done, audio_tb
                    container.mux(astream.encode(frame))
                    done += chunk.shape[1]
                return done

            # Interleave: after each video frame, encode the audio up to that frame's end time.
            audio_done = 0
            for i in range(n_frames):
                container.mux(vstream.encode(_rgb_frame(video[i], i)))
                audio_done = encode_audio_until(audio_done, (i + 1) * sample_rate // fps + 1)
            container.mux(vstream.encode(None))
            encode_audio_until(audio_done, n_samples)
            container.mux(astream.encode(None))
